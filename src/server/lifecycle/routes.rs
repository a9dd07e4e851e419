//! The lifecycle routes: `GET /v1/capabilities`, `POST /v1/models/load` (202 and a task
//! to poll at `GET /v1/models/load/{taskId}`), `POST /v1/models/unload` and
//! `POST /v1/cache/flush` (answered when done, or 202 with the task after
//! [`SYNC_WAIT`]). Operations need the admin token or a `verifiedOpToken`
//! ([`governance`]); the dispatcher picks the workers and carries them out.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::capabilities;
use super::governance::{self, Operation};
use crate::protocol::lifecycle::OperationKind;
use crate::server::auth::{authorize_admin, authorize_client};
use crate::server::dispatcher::lifecycle::{OpRefusal, OperationRequest, TaskView};
use crate::server::dispatcher::runtime::{ask, Answer, Query};
use crate::server::errors::{ApiError, Style};
use crate::server::http::request::{Conn, Request};
use crate::server::reply::write_error;
use crate::server::usage::unix_now;
use crate::server::Ctx;

/// How long unload and flush wait for their task before answering 202.
pub const SYNC_WAIT: Duration = Duration::from_secs(30);
/// After this a load that no runner finished fails (a pull of a large model is slow).
const LOAD_TIMEOUT: Duration = Duration::from_secs(3600);
/// After this an unload or flush that no runner finished fails.
const QUICK_TIMEOUT: Duration = Duration::from_secs(120);

type Outcome = Result<(u16, Value), ApiError>;

fn finish(conn: &mut Conn, req: &Request, outcome: Outcome) -> bool {
    match outcome {
        Ok((status, body)) => conn.write_json(status, &body, req.keep_alive),
        Err(e) => write_error(conn, Style::OpenAi, &e, req.keep_alive, None),
    }
}

/// `GET /v1/capabilities[?runner=NAME]`.
pub fn capabilities(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let outcome = (|| {
        authorize_client(ctx, req, conn.peer.ip())?;
        if ctx.shared.is_shutting_down() {
            return Err(ApiError::new(
                503,
                "shutting_down",
                "the relay is shutting down",
            ));
        }
        let (workers, stats) = capabilities::snapshot(&ctx.inputs)
            .ok_or_else(|| ApiError::new(503, "shutting_down", "the relay is shutting down"))?;
        let queue = capabilities::queue(&stats, ctx.cfg.dispatch.max_queue_len);
        match req.query_param("runner") {
            None => Ok((200, capabilities::pool(&workers, &queue))),
            Some(name) => workers
                .iter()
                .find(|w| w.name == name)
                .map(|w| (200, capabilities::runner(w, &queue)))
                .ok_or_else(|| refusal(&OpRefusal::RunnerNotFound(name))),
        }
    })();
    finish(conn, req, outcome)
}

/// `POST /v1/models/load`: `{"modelId", "runner"?, "verifiedOpToken"?}`.
pub fn load(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let outcome = (|| {
        let body = json_body(req)?;
        let model = model_id(&body)?;
        authorize(ctx, conn, req, &body, Operation::Load, &model)?;
        let task = start(
            ctx,
            OperationKind::Load,
            Some(model),
            runner(&body),
            LOAD_TIMEOUT,
        )?;
        Ok((202, task_json(&task)))
    })();
    finish(conn, req, outcome)
}

/// `POST /v1/models/unload`: `{"modelId", "runner"?, "verifiedOpToken"?}`.
pub fn unload(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let outcome = (|| {
        let body = json_body(req)?;
        let model = model_id(&body)?;
        authorize(ctx, conn, req, &body, Operation::Unload, &model)?;
        let task = start(
            ctx,
            OperationKind::Unload,
            Some(model),
            runner(&body),
            QUICK_TIMEOUT,
        )?;
        settle(ctx, task)
    })();
    finish(conn, req, outcome)
}

/// `POST /v1/cache/flush`: `{"scope": "all"|"model"|"tenant"|"tag", "modelId"?,
/// "tenantId"?, "tag"?, "runner"?, "verifiedOpToken"?}`. Backends keep no cache per
/// tenant or tag, so those scopes flush every cache: more than asked, never less.
pub fn flush(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let outcome = (|| {
        let body = json_body(req)?;
        let text = |k: &str| {
            body.get(k)
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
        };
        let scope = text("scope").unwrap_or("all");
        let (value, model) = match scope {
            "all" => (None, None),
            "model" => {
                let m = text("modelId").or_else(|| text("model")).ok_or_else(|| {
                    ApiError::new(400, "invalid_request", "scope `model` needs `modelId`")
                })?;
                (Some(m), Some(m.to_string()))
            }
            "tenant" => (text("tenantId").or_else(|| text("tenant")), None),
            "tag" => (text("tag"), None),
            other => {
                return Err(ApiError::new(
                    400,
                    "invalid_request",
                    format!("unknown scope {other:?}: all, model, tenant or tag"),
                ))
            }
        };
        let target = governance::flush_target(scope, value);
        authorize(ctx, conn, req, &body, Operation::Flush, &target)?;
        let task = start(
            ctx,
            OperationKind::Flush,
            model,
            runner(&body),
            QUICK_TIMEOUT,
        )?;
        let (status, mut answer) = settle(ctx, task)?;
        answer["scope"] = json!(scope);
        answer["scopeWidened"] = json!(matches!(scope, "tenant" | "tag"));
        Ok((status, answer))
    })();
    finish(conn, req, outcome)
}

/// `GET /v1/models/load/{taskId}` (any operation's task id).
pub fn task(conn: &mut Conn, ctx: &Ctx, req: &Request, task_id: &str) -> bool {
    let outcome = (|| {
        authorize_client(ctx, req, conn.peer.ip())?;
        match ask(&ctx.inputs, Query::Task(task_id.to_string())) {
            Some(Answer::Task(Some(task))) => Ok((200, task_json(&task))),
            Some(Answer::Task(None)) => ctx
                .store
                .task_mirror()
                // Started on another relay?
                .and_then(|m| super::shared_tasks::lookup(m.as_ref(), task_id))
                .map(|task| (200, task))
                .ok_or_else(|| {
                    ApiError::new(
                        404,
                        "task_not_found",
                        format!(
                            "no task {task_id:?} (finished tasks are kept for a while, then forgotten)"
                        ),
                    )
                }),
            _ => Err(ApiError::new(
                503,
                "shutting_down",
                "the relay is shutting down",
            )),
        }
    })();
    finish(conn, req, outcome)
}

fn json_body(req: &Request) -> Result<Value, ApiError> {
    if req.body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    let v: Value = serde_json::from_slice(&req.body)
        .map_err(|e| ApiError::new(400, "invalid_json", format!("body is not JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::new(
            400,
            "invalid_json",
            "body must be a JSON object",
        ));
    }
    Ok(v)
}

fn model_id(body: &Value) -> Result<String, ApiError> {
    body.get("modelId")
        .or_else(|| body.get("model"))
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty() && m.len() <= 256)
        .map(str::to_string)
        .ok_or_else(|| ApiError::new(400, "invalid_request", "`modelId` is required"))
}

fn runner(body: &Value) -> Option<String> {
    body.get("runner")
        .or_else(|| body.get("runnerId"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// The admin token, or a `verifiedOpToken` in the `X-Op-Token` header or the body.
fn authorize(
    ctx: &Ctx,
    conn: &Conn,
    req: &Request,
    body: &Value,
    op: Operation,
    target: &str,
) -> Result<(), ApiError> {
    let token = req
        .header(governance::OP_TOKEN_HEADER)
        .map(Cow::Borrowed)
        .or_else(|| governance::token_from_body(body));
    // A wrong admin token is a failed authentication (counted per IP); none at all is
    // fine when an op token comes instead.
    let admin_ok = match req.header("authorization") {
        Some(_) if ctx.cfg.admin_token.is_some() => {
            match authorize_admin(ctx, req, conn.peer.ip()) {
                Ok(()) => true,
                Err(e) if token.is_none() => return Err(e),
                Err(_) => false,
            }
        }
        _ => false,
    };
    ctx.governance
        .authorize(token.as_deref(), op, target, admin_ok, unix_now())
        .map(|_| ())
        .map_err(|r| ApiError::new(r.status(), r.code(), r.message()))
}

fn start(
    ctx: &Ctx,
    kind: OperationKind,
    model: Option<String>,
    runner: Option<String>,
    timeout: Duration,
) -> Result<TaskView, ApiError> {
    let req = OperationRequest {
        kind,
        model,
        runner,
    };
    match ask(&ctx.inputs, Query::StartOperation(req, timeout)) {
        Some(Answer::Operation(Ok(task))) => {
            if let Some(mirror) = ctx.store.task_mirror() {
                let (inputs, shared) = (ctx.inputs.clone(), ctx.shared.clone());
                super::shared_tasks::follow(task.task_id.clone(), mirror, inputs, shared);
            }
            Ok(task)
        }
        Some(Answer::Operation(Err(r))) => Err(refusal(&r)),
        _ => Err(ApiError::new(
            503,
            "shutting_down",
            "the relay is shutting down",
        )),
    }
}

/// Waits up to [`SYNC_WAIT`] for a task to end: 200 when it completed, the runners'
/// reasons when it did not (501 if no runner could, 502 if one failed), 202 with the
/// task when it still runs.
fn settle(ctx: &Ctx, mut task: TaskView) -> Outcome {
    let deadline = Instant::now() + SYNC_WAIT;
    let mut pause = Duration::from_millis(5);
    while task.status == "running" && Instant::now() < deadline {
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
        if let Some(Answer::Task(Some(t))) = ask(&ctx.inputs, Query::Task(task.task_id.clone())) {
            task = t;
        }
    }
    let body = task_json(&task);
    match task.status {
        "running" => Ok((202, body)),
        "completed" => Ok((200, body)),
        status => {
            let (code, http) = if status == "not_supported" {
                ("not_supported", 501)
            } else {
                ("operation_failed", 502)
            };
            Err(ApiError::new(http, code, reasons(&task)).field("task", body))
        }
    }
}

/// "gpu-1: <message>; gpu-2: <message>" for the parts that did not complete.
fn reasons(task: &TaskView) -> String {
    let parts: Vec<String> = task
        .parts
        .iter()
        .filter(|p| p.status != "completed")
        .map(|p| {
            format!(
                "{} ({}): {}",
                p.runner,
                p.backend.as_deref().unwrap_or("unknown backend"),
                p.message.as_deref().unwrap_or(p.status)
            )
        })
        .collect();
    format!("{} {}", task.operation.as_str(), parts.join("; "))
}

fn refusal(r: &OpRefusal) -> ApiError {
    ApiError::new(r.status(), r.code(), r.message())
}

/// The seed's task shape, plus each runner's part.
pub fn task_json(t: &TaskView) -> Value {
    let status = match (t.operation, t.status) {
        (OperationKind::Load, "running") => "loading",
        (OperationKind::Unload, "running") => "unloading",
        (OperationKind::Flush, "running") => "flushing",
        (_, s) => s,
    };
    let parts: Vec<Value> = t
        .parts
        .iter()
        .map(|p| {
            json!({
                "runnerId": p.runner,
                "status": p.status,
                "progress": p.progress,
                "message": p.message,
                "backend": p.backend,
            })
        })
        .collect();
    let error = matches!(t.status, "failed" | "not_supported").then(|| reasons(t));
    json!({
        "taskId": t.task_id,
        "error": error,
        "operation": t.operation.as_str(),
        "status": status,
        "modelId": t.model,
        "progress": t.progress,
        "eta": t.eta_secs,
        "elapsedMs": t.elapsed_ms,
        "runners": parts,
    })
}
