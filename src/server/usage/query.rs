//! `GET /admin/usage?from=&to=&group_by=key|tenant|model|worker&bucket=hour|day`: the
//! usage journal summed per hour or UTC day and per group, as JSON or, with
//! `Accept: text/csv`, as CSV.
//!
//! `from` and `to` take unix seconds or RFC 3339 (`2026-11-01`, `2026-11-01T12:00:00Z`);
//! `from` is inclusive and `to` exclusive, both widened to whole buckets. Defaults:
//! `to` = now, `from` = 24 hours (bucket `hour`) or 30 days (bucket `day`) before `to`,
//! `group_by` = `model`, `bucket` = `hour`.

use serde_json::{json, Value};

use std::collections::BTreeMap;

use super::journal::{bucket_start, Bucket, GroupBy, Journal, Key, Row, Usage};
use super::unix_now;
use crate::rfc3339;
use crate::server::auth::authorize_admin;
use crate::server::errors::{ApiError, Style};
use crate::server::http::request::{Conn, Request};
use crate::server::reply::write_error;
use crate::server::Ctx;

/// What one report asks for, from the query string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Unix seconds, inclusive, at a bucket start.
    pub from: u64,
    /// Unix seconds, exclusive, at a bucket start.
    pub to: u64,
    pub group_by: GroupBy,
    pub bucket: Bucket,
}

/// Reads a [`Report`] from query parameters (`param("from")`...), relative to `now`.
pub fn parse(param: impl Fn(&str) -> Option<String>, now: u64) -> Result<Report, ApiError> {
    let group_by = match param("group_by").as_deref() {
        None | Some("model") => GroupBy::Model,
        Some("key") => GroupBy::Key,
        Some("tenant") => GroupBy::Tenant,
        Some("worker") => GroupBy::Worker,
        Some(other) => return Err(invalid("group_by", other, "key, tenant, model or worker")),
    };
    let (bucket, width, default_span) = match param("bucket").as_deref() {
        None | Some("hour") => (Bucket::Hour, 3600, 24 * 3600),
        Some("day") => (Bucket::Day, 86_400, 30 * 86_400),
        Some(other) => return Err(invalid("bucket", other, "hour or day")),
    };
    let to = match param("to") {
        Some(t) => instant("to", &t)?,
        None => now,
    };
    let from = match param("from") {
        Some(f) => instant("from", &f)?,
        None => to.saturating_sub(default_span),
    };
    if from > to {
        return Err(ApiError::new(
            400,
            "invalid_range",
            "`from` must not be after `to`",
        ));
    }
    Ok(Report {
        from: from / width * width,
        to: to.div_ceil(width).saturating_mul(width),
        group_by,
        bucket,
    })
}

fn instant(name: &str, text: &str) -> Result<u64, ApiError> {
    text.parse::<u64>()
        .ok()
        .or_else(|| rfc3339::parse(text))
        .ok_or_else(|| invalid(name, text, "unix seconds or an RFC 3339 date/time"))
}

fn invalid(name: &str, value: &str, expected: &str) -> ApiError {
    let shown: String = value.chars().take(64).collect();
    ApiError::new(
        400,
        "invalid_parameter",
        format!("{name}={shown:?} is not valid; expected {expected}"),
    )
    .field("param", name.to_string())
}

impl Report {
    pub fn rows(&self, journal: &Journal) -> Vec<Row> {
        journal.query(self.from / 3600, self.to / 3600, self.group_by, self.bucket)
    }

    /// `rows` (this relay's) with the other relays' buckets added in, same grouping
    /// and order.
    pub fn with_others(&self, rows: Vec<Row>, others: &[(Key, Usage)]) -> Vec<Row> {
        let mut sums: BTreeMap<(u64, String), Usage> = rows
            .into_iter()
            .map(|r| ((r.start, r.group), r.usage))
            .collect();
        let (from, to) = (self.from / 3600, self.to / 3600);
        for (key, usage) in others.iter().filter(|(k, _)| k.hour >= from && k.hour < to) {
            let group = match self.group_by {
                GroupBy::Key => &key.key,
                GroupBy::Tenant => &key.tenant,
                GroupBy::Model => &key.model,
                GroupBy::Worker => &key.worker,
            };
            sums.entry((bucket_start(key.hour, self.bucket), group.clone()))
                .or_default()
                .add(usage);
        }
        sums.into_iter()
            .map(|((start, group), usage)| Row {
                start,
                group,
                usage,
            })
            .collect()
    }

    fn group_name(&self) -> &'static str {
        match self.group_by {
            GroupBy::Key => "key",
            GroupBy::Tenant => "tenant",
            GroupBy::Model => "model",
            GroupBy::Worker => "worker",
        }
    }

    fn bucket_name(&self) -> &'static str {
        match self.bucket {
            Bucket::Hour => "hour",
            Bucket::Day => "day",
        }
    }

    /// The JSON report: the request echoed, one object per row, and the totals.
    pub fn json(&self, rows: &[Row]) -> Value {
        let group = self.group_name();
        let mut totals = Usage::default();
        let rows: Vec<Value> = rows
            .iter()
            .map(|r| {
                totals.add(&r.usage);
                let mut row = json!({
                    "start": rfc3339::format_secs(r.start),
                    "start_unix": r.start,
                    "requests": r.usage.requests,
                    "input_tokens": r.usage.tokens_in,
                    "output_tokens": r.usage.tokens_out,
                });
                row[group] = json!(r.group);
                row
            })
            .collect();
        json!({
            "from": rfc3339::format_secs(self.from),
            "to": rfc3339::format_secs(self.to),
            "group_by": group,
            "bucket": self.bucket_name(),
            "rows": rows,
            "totals": {
                "requests": totals.requests,
                "input_tokens": totals.tokens_in,
                "output_tokens": totals.tokens_out,
            },
        })
    }

    /// The CSV report: a header line, then one line per row.
    pub fn csv(&self, rows: &[Row]) -> String {
        let mut out = format!(
            "start,{},requests,input_tokens,output_tokens\r\n",
            self.group_name()
        );
        for r in rows {
            out.push_str(&format!(
                "{},{},{},{},{}\r\n",
                rfc3339::format_secs(r.start),
                csv_field(&r.group),
                r.usage.requests,
                r.usage.tokens_in,
                r.usage.tokens_out
            ));
        }
        out
    }
}

/// A CSV field (RFC 4180 quoting). Names come from clients (model names, tenants), so a
/// leading `=`, `+`, `@` or `-` that a spreadsheet would run as a formula is defused
/// with a `'` (the bare "-" placeholder stays as it is).
pub fn csv_field(value: &str) -> String {
    let formula = value.len() > 1 && value.starts_with(['=', '+', '@', '-', '\t', '\r']);
    let value = if formula {
        format!("'{value}")
    } else {
        value.to_string()
    };
    if value.contains([',', '"', '\r', '\n']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value
    }
}

/// `GET /admin/usage`.
pub fn serve(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let keep = req.keep_alive;
    if let Err(e) = authorize_admin(ctx, req, conn.peer.ip()) {
        return write_error(conn, Style::OpenAi, &e, keep, None);
    }
    let Some(journal) = ctx.usage.journal() else {
        let e = ApiError::new(503, "usage_not_recorded", "usage is not being recorded");
        return write_error(conn, Style::OpenAi, &e, keep, None);
    };
    let report = match parse(|name| req.query_param(name), unix_now()) {
        Ok(r) => r,
        Err(e) => return write_error(conn, Style::OpenAi, &e, keep, None),
    };
    let mut rows = report.rows(journal);
    // With a shared store: the fleet's figures, or this relay's alone (said in the
    // answer) while the store is unreachable.
    let mut fleet = None;
    if let Some(mirror) = ctx.usage.mirror() {
        fleet = Some(match mirror.others(report.from / 3600, report.to / 3600) {
            Ok(others) => {
                rows = report.with_others(rows, &others.buckets);
                json!({"complete": true, "relays": others.relays})
            }
            Err(e) => json!({"complete": false, "error": e}),
        });
    }
    if wants_csv(req) {
        let body = report.csv(&rows);
        conn.write_full(200, "text/csv; charset=utf-8", body.as_bytes(), keep)
    } else {
        let mut body = report.json(&rows);
        if let Some(fleet) = fleet {
            body["fleet"] = fleet;
        }
        conn.write_json(200, &body, keep)
    }
}

fn wants_csv(req: &Request) -> bool {
    req.header("accept").is_some_and(|accept| {
        accept
            .split(',')
            .any(|t| t.trim().to_ascii_lowercase().starts_with("text/csv"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    const NOW: u64 = 1_763_820_000; // 2025-11-22T14:00:00Z

    #[test]
    fn defaults_are_the_last_day_by_model_and_hour() {
        let r = parse(params(&[]), NOW + 10).expect("defaults");
        assert_eq!(r.group_by, GroupBy::Model);
        assert_eq!(r.bucket, Bucket::Hour);
        assert_eq!(r.to, NOW + 3600, "to widens to the end of its hour");
        assert_eq!(r.from, NOW - 24 * 3600);
    }

    #[test]
    fn accepts_unix_seconds_and_dates_and_aligns_days() {
        let r = parse(
            params(&[
                ("from", "2025-11-01"),
                ("to", "1763820000"),
                ("bucket", "day"),
                ("group_by", "tenant"),
            ]),
            NOW,
        )
        .expect("valid");
        assert_eq!(r.from, rfc3339::parse("2025-11-01").unwrap_or(0));
        assert_eq!(r.to, rfc3339::parse("2025-11-23").unwrap_or(0));
        assert_eq!(r.group_by, GroupBy::Tenant);
    }

    #[test]
    fn refuses_bad_parameters_by_name() {
        for (pairs, param) in [
            (vec![("group_by", "colour")], "group_by"),
            (vec![("bucket", "week")], "bucket"),
            (vec![("from", "yesterday")], "from"),
            (vec![("to", "2025-02-30")], "to"),
        ] {
            let e = parse(params(&pairs), NOW).expect_err("invalid");
            assert_eq!(e.status, 400);
            assert_eq!(e.code, "invalid_parameter");
            assert!(e.message.contains(param), "{}", e.message);
        }
        let e = parse(params(&[("from", "200"), ("to", "100")]), NOW).expect_err("range");
        assert_eq!(e.code, "invalid_range");
    }

    #[test]
    fn csv_quotes_and_defuses_formulas() {
        assert_eq!(csv_field("gemma"), "gemma");
        assert_eq!(csv_field("-"), "-");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("=cmd()"), "'=cmd()");
        assert_eq!(csv_field("-2+3"), "'-2+3");
    }

    #[test]
    fn renders_rows_and_totals() {
        let r = parse(params(&[("group_by", "key")]), NOW).expect("valid");
        let rows = vec![
            Row {
                start: NOW - 3600,
                group: "k1".into(),
                usage: Usage {
                    requests: 2,
                    tokens_in: 10,
                    tokens_out: 4,
                },
            },
            Row {
                start: NOW,
                group: "x,y".into(),
                usage: Usage {
                    requests: 1,
                    tokens_in: 5,
                    tokens_out: 1,
                },
            },
        ];
        let v = r.json(&rows);
        assert_eq!(v["rows"][0]["key"], "k1");
        assert_eq!(v["rows"][1]["start"], "2025-11-22T14:00:00Z");
        assert_eq!(v["totals"]["input_tokens"], 15);
        assert_eq!(v["totals"]["requests"], 3);
        let csv = r.csv(&rows);
        assert_eq!(
            csv,
            "start,key,requests,input_tokens,output_tokens\r\n\
             2025-11-22T13:00:00Z,k1,2,10,4\r\n\
             2025-11-22T14:00:00Z,\"x,y\",1,5,1\r\n"
        );
    }
}
