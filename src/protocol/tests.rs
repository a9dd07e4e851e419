//! Unit tests of `protocol`.

use super::*;

#[test]
fn parses_the_documented_register_and_ignores_unknown_fields() {
    let text = r#"{"type":"register","worker_name":"gpu-box-1","models":["llama3-8b"],
        "max_concurrent":4,"protocol_version":"1","current_load":0,"gpu":"4090"}"#;
    let WorkerMessage::Register(reg) = WorkerMessage::parse(text).unwrap() else {
        panic!("not a register")
    };
    assert_eq!(reg.worker_name, "gpu-box-1");
    assert_eq!(reg.models, vec!["llama3-8b"]);
    assert_eq!(reg.max_concurrent, 4);
    assert_eq!(reg.protocol_version.as_deref(), Some("1"));
}

#[test]
fn unknown_type_is_not_an_error() {
    let msg = WorkerMessage::parse(r#"{"type":"telemetry","x":1}"#).unwrap();
    assert_eq!(msg, WorkerMessage::Unknown("telemetry".into()));
    let msg = ServerMessage::parse(r#"{"type":"future_thing"}"#).unwrap();
    assert_eq!(msg, ServerMessage::Unknown("future_thing".into()));
}

#[test]
fn missing_required_field_is_malformed() {
    let err = WorkerMessage::parse(r#"{"type":"response_chunk","request_id":"r"}"#);
    assert!(err.unwrap_err().0.contains("chunk"));
    assert!(WorkerMessage::parse("not json").is_err());
    assert!(WorkerMessage::parse(r#"{"no_type":1}"#).is_err());
}

#[test]
fn server_messages_serialize_in_the_documented_shape() {
    let cancel = ServerMessage::Cancel {
        request_id: "r-1".into(),
        reason: CancelReason::ClientDisconnect,
    };
    assert_eq!(
        to_json(&cancel),
        r#"{"type":"cancel","request_id":"r-1","reason":"client_disconnect"}"#
    );
    let req = ServerMessage::Request(Arc::new(RequestMessage {
        request_id: "r-2".into(),
        model: "m".into(),
        endpoint_path: "/v1/chat/completions".into(),
        is_streaming: true,
        body: Arc::from("{\"model\":\"m\"}"),
        headers: HeaderMap::new(),
        body_encoding: None,
        continuation: None,
        held: None,
    }));
    assert_eq!(
        to_json(&req),
        r#"{"type":"request","request_id":"r-2","model":"m","endpoint_path":"/v1/chat/completions","is_streaming":true,"body":"{\"model\":\"m\"}"}"#
    );
    let ack = ServerMessage::RegisterAck(RegisterAck {
        worker_id: "w-1".into(),
        models: vec!["m".into()],
        warnings: vec![],
        protocol_version: Some("1".into()),
        features: vec![],
        heartbeat_interval_secs: None,
    });
    assert_eq!(
        to_json(&ack),
        r#"{"type":"register_ack","worker_id":"w-1","models":["m"],"protocol_version":"1"}"#
    );
}

#[test]
fn worker_messages_round_trip_through_the_lenient_parser() {
    let msgs = vec![
        WorkerMessage::ResponseChunk {
            request_id: "r".into(),
            chunk: "data: {\"x\":\"é\"}\n\n".into(),
        },
        WorkerMessage::ResponseComplete(ResponseComplete {
            request_id: "r".into(),
            status_code: 200,
            headers: HeaderMap::from([("content-type".into(), "application/json".into())]),
            body: Some("{}".into()),
            token_counts: Some(TokenCounts {
                prompt_tokens: Some(1),
                completion_tokens: Some(2),
                total_tokens: Some(3),
            }),
        }),
        WorkerMessage::Pong {
            current_load: 2,
            timestamp_unix_ms: Some(5),
        },
        WorkerMessage::ModelsUpdate {
            models: vec!["a".into()],
            current_load: 1,
            loaded_models: Some(vec!["a".into()]),
            model_info: Some(ModelInfoMap::from([(
                "a".into(),
                ModelInfo {
                    context_length: Some(8192),
                    capabilities: vec!["completion".into(), "tools".into()],
                },
            )])),
        },
        WorkerMessage::WorkerDraining {},
        WorkerMessage::ResponseHead {
            request_id: "r".into(),
            status_code: 200,
            headers: HeaderMap::from([("x-context-trimmed".into(), "2".into())]),
        },
        WorkerMessage::Error {
            request_id: Some("r".into()),
            code: "backend_unavailable".into(),
            message: "backend answered 503".into(),
            status_code: Some(503),
            retryable: Some(true),
            headers: HeaderMap::from([("content-type".into(), "application/json".into())]),
            body: Some(r#"{"error":{"message":"model overloaded"}}"#.into()),
        },
        WorkerMessage::Load { in_flight: 3 },
        WorkerMessage::Relays {
            relays: vec!["ws://a/v1/worker/connect".into()],
        },
        WorkerMessage::Busy {
            request_id: "r".into(),
            in_flight: 4,
        },
    ];
    for msg in msgs {
        assert_eq!(WorkerMessage::parse(&to_json(&msg)).unwrap(), msg);
    }
}

#[test]
fn load_and_busy_have_the_documented_shape() {
    assert_eq!(
        to_json(&WorkerMessage::Load { in_flight: 3 }),
        r#"{"type":"load","in_flight":3}"#
    );
    assert_eq!(
        to_json(&WorkerMessage::Busy {
            request_id: "r-1".into(),
            in_flight: 4
        }),
        r#"{"type":"busy","request_id":"r-1","in_flight":4}"#
    );
    assert!(WorkerMessage::parse(r#"{"type":"busy","in_flight":1}"#).is_err());
    assert!(WorkerMessage::parse(r#"{"type":"load"}"#).is_err());
}

#[test]
fn cancel_reason_accepts_strings_and_the_other_shape() {
    let msg = ServerMessage::parse(r#"{"type":"cancel","request_id":"r","reason":"timeout"}"#);
    assert!(matches!(
        msg,
        Ok(ServerMessage::Cancel {
            reason: CancelReason::Timeout,
            ..
        })
    ));
    let msg = ServerMessage::parse(r#"{"type":"cancel","request_id":"r","reason":{"other":"x"}}"#);
    assert!(matches!(msg, Ok(ServerMessage::Cancel { .. })));
}

#[test]
fn model_info_is_read_leniently() {
    let text = r#"{"type":"models_update","models":["a","b","c","d"],"current_load":0,
        "model_info":{"a":{"context_length":4096,"capabilities":["completion",7,"vision"]},
        "b":{"context_length":"big"},"c":"nonsense","d":{"context_length":-1,"capabilities":null}}}"#;
    let WorkerMessage::ModelsUpdate { model_info, .. } = WorkerMessage::parse(text).unwrap() else {
        panic!("not a models_update")
    };
    let info = model_info.unwrap();
    assert_eq!(info.len(), 3, "the non-object entry is dropped: {info:?}");
    assert_eq!(info["a"].context_length, Some(4096));
    assert_eq!(info["a"].capabilities, vec!["completion", "vision"]);
    assert_eq!(info["b"], ModelInfo::default());
    assert_eq!(info["d"], ModelInfo::default());
    // Not an object at all: absent, and the message still parses.
    let text = r#"{"type":"register","max_concurrent":1,"model_info":[1,2]}"#;
    let WorkerMessage::Register(reg) = WorkerMessage::parse(text).unwrap() else {
        panic!("not a register")
    };
    assert_eq!(reg.model_info, None);
    // On the wire an unknown context length is `null`.
    let msg = WorkerMessage::ModelsUpdate {
        models: vec!["a".into()],
        current_load: 0,
        loaded_models: None,
        model_info: Some(ModelInfoMap::from([("a".into(), ModelInfo::default())])),
    };
    assert!(
        to_json(&msg).contains(r#""model_info":{"a":{"context_length":null,"capabilities":[]}}"#)
    );
}

#[test]
fn versions() {
    assert!(is_supported_version(None));
    assert!(is_supported_version(Some("1")));
    assert!(is_supported_version(Some("2026-04-bridge-v1")));
    assert!(!is_supported_version(Some("2")));
}

#[test]
fn a_continuation_travels_on_request_and_an_old_request_has_none() {
    let mut msg = RequestMessage {
        request_id: "r-3".into(),
        model: "m".into(),
        endpoint_path: "/v1/chat/completions".into(),
        is_streaming: true,
        body: Arc::from("{}"),
        headers: HeaderMap::new(),
        body_encoding: None,
        continuation: Some(super::continuation::Continuation {
            prefix: "Once upon".into(),
            tokens: 2,
        }),
        held: None,
    };
    let text = to_json(&ServerMessage::Request(Arc::new(msg.clone())));
    assert!(text.ends_with(r#""continuation":{"prefix":"Once upon","tokens":2}}"#));
    assert_eq!(
        ServerMessage::parse(&text),
        Ok(ServerMessage::Request(Arc::new(msg.clone())))
    );
    // Lenient: a missing count is zero; a request without it is an ordinary one.
    let bare = text.replace(r#","tokens":2"#, "");
    match ServerMessage::parse(&bare) {
        Ok(ServerMessage::Request(r)) => assert_eq!(r.continuation.as_ref().unwrap().tokens, 0),
        other => panic!("{other:?}"),
    }
    msg.continuation = None;
    let old = to_json(&ServerMessage::Request(Arc::new(msg.clone())));
    assert!(!old.contains("continuation"));
    assert_eq!(
        ServerMessage::parse(&old),
        Ok(ServerMessage::Request(Arc::new(msg)))
    );
}

#[test]
fn sized_serialization_writes_what_plain_serialization_writes() {
    let body = "{\"messages\":[{\"content\":\"line\\none \\u0001\"}]}".repeat(40);
    let complete = WorkerMessage::ResponseComplete(ResponseComplete {
        request_id: "r-1".into(),
        status_code: 200,
        headers: [("content-type".to_string(), "application/json".to_string())].into(),
        body: Some(body.clone()),
        token_counts: None,
    });
    let request = ServerMessage::Request(Arc::new(RequestMessage {
        request_id: "r-2".into(),
        model: "m".into(),
        endpoint_path: "/v1/chat/completions".into(),
        is_streaming: false,
        body: body.as_str().into(),
        headers: HeaderMap::new(),
        body_encoding: None,
        continuation: None,
        held: None,
    }));
    let ping = ServerMessage::Ping {
        timestamp_unix_ms: Some(1),
    };
    // Room for the body at least: the hint is what keeps the buffer from doubling.
    assert!(complete.text_hint() > body.len());
    assert!(request.text_hint() > body.len());
    for (sized, plain) in [
        (
            to_json_sized(&complete, complete.text_hint()),
            to_json(&complete),
        ),
        (
            to_json_sized(&request, request.text_hint()),
            to_json(&request),
        ),
        (to_json_sized(&ping, 0), to_json(&ping)),
    ] {
        assert_eq!(sized, plain);
    }
}
