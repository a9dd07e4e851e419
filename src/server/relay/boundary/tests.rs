use super::*;

/// The events an SSE parser dispatches from `text`, by the WHATWG rules: lines end with
/// `\r\n`, `\n` or `\r`; `data:` lines accumulate; a blank line dispatches; whatever is
/// unfinished at the end is discarded.
fn sse_events(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' => {
                if chars.peek() == Some(&'\n') {
                    chars.next();
                }
                lines.push(std::mem::take(&mut line));
            }
            '\n' => lines.push(std::mem::take(&mut line)),
            c => line.push(c),
        }
    }
    let mut events = Vec::new();
    let mut data: Option<String> = None;
    for line in lines {
        if line.is_empty() {
            events.extend(data.take());
        } else if let Some(value) = line.strip_prefix("data:") {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            }
        }
    }
    events
}

const ERROR_EVENT: &str = "data: {\"error\":{\"code\":\"backend_stream_failed\"}}\n\n";
const ERROR_DATA: &str = "{\"error\":{\"code\":\"backend_stream_failed\"}}";

/// Feeds `pieces`, then fails: what the client receives.
fn fail_after(format: Format, pieces: &[&str], error: &str) -> String {
    let mut b = EventBoundary::new(format);
    let mut out = String::new();
    for piece in pieces {
        out.push_str(&b.push(piece));
    }
    out.push_str(b.abandon().close);
    out.push_str(error);
    out
}

#[test]
fn whole_events_pass_at_once_without_a_copy() {
    let mut b = EventBoundary::new(Format::Sse);
    let text = "data: {\"n\":1}\n\ndata: {\"n\":2}\n\n";
    assert!(matches!(b.push(text), Cow::Borrowed(t) if t == text));
    assert!(b.at_boundary());
}

#[test]
fn the_start_of_an_event_waits_for_its_end() {
    let mut b = EventBoundary::new(Format::Sse);
    assert_eq!(
        b.push("data: {\"n\":1}\n\ndata: {\"ch"),
        "data: {\"n\":1}\n\n"
    );
    assert!(!b.at_boundary());
    assert_eq!(b.push("oices\":[]}\n"), "");
    assert_eq!(b.push("\ndata: {"), "data: {\"choices\":[]}\n\n");
    assert_eq!(b.finish(), "data: {");
    assert!(b.at_boundary());
}

#[test]
fn a_stream_cut_inside_an_event_ends_with_the_error_event_whole() {
    let out = fail_after(
        Format::Sse,
        &["data: {\"n\":1}\n\n", "data: {\"choi"],
        ERROR_EVENT,
    );
    assert_eq!(out, format!("data: {{\"n\":1}}\n\n{ERROR_EVENT}"));
    assert_eq!(sse_events(&out), ["{\"n\":1}", ERROR_DATA]);
}

#[test]
fn a_data_line_without_its_blank_line_is_withheld_too() {
    // Forwarded, this line would join the error's data in one event (`{..}\n{..}`).
    let out = fail_after(Format::Sse, &["data: {\"n\":1}\n"], ERROR_EVENT);
    assert_eq!(out, ERROR_EVENT);
}

#[test]
fn abandon_reports_what_it_dropped() {
    let mut b = EventBoundary::new(Format::Sse);
    assert_eq!(
        b.push("data: {\"n\":1}\n\ndata: {\"c"),
        "data: {\"n\":1}\n\n"
    );
    let cut = b.abandon();
    assert_eq!(
        cut,
        Abandoned {
            withheld: 9,
            close: ""
        }
    );
    assert!(b.at_boundary());
}

#[test]
fn anthropic_event_lines_stay_with_their_data() {
    let mut b = EventBoundary::new(Format::Sse);
    let whole = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\"}\n\n";
    assert_eq!(b.push(&whole[..27]), "");
    assert_eq!(b.push(&whole[27..]), whole);
    let error = "event: error\ndata: {\"type\":\"error\"}\n\n";
    let out = fail_after(
        Format::Sse,
        &[whole, "event: content_block_delta\ndata: {\"ty"],
        error,
    );
    assert_eq!(out, format!("{whole}{error}"));
}

#[test]
fn crlf_and_cr_line_ends_are_event_ends_too() {
    let mut b = EventBoundary::new(Format::Sse);
    assert_eq!(b.push("data: 1\r\n\r\ndata: 2"), "data: 1\r\n\r\n");
    assert_eq!(b.push("\r\rdata: 3\r"), "data: 2\r\r");
    // `\r` then `\n` in the next piece: one line end, not a blank line.
    assert_eq!(b.push("\n"), "");
    assert_eq!(b.push("\r"), "data: 3\r\n\r");
    // The `\n` completing that `\r\n` goes out with the next event.
    assert_eq!(b.push("\ndata: 4\n\n"), "\ndata: 4\n\n");
    assert!(b.at_boundary());
}

#[test]
fn a_blank_line_split_between_pieces_ends_the_event() {
    let mut b = EventBoundary::new(Format::Sse);
    assert_eq!(b.push("data: 1\n"), "");
    assert_eq!(b.push("\n"), "data: 1\n\n");
    assert_eq!(b.push("data: 2\r\n\r"), "data: 2\r\n\r");
    assert_eq!(b.push("\n"), "\n");
}

#[test]
fn a_piece_ending_in_two_newlines_ends_an_event_whatever_came_before() {
    let mut b = EventBoundary::new(Format::Sse);
    assert_eq!(b.push("data: 1\r"), "");
    assert_eq!(b.push("\n\n"), "data: 1\r\n\n");
    assert_eq!(b.push("data: 2\r\r"), "data: 2\r\r");
    assert_eq!(b.push("\n\n"), "\n\n");
    assert_eq!(b.push("data: 3\n"), "");
    assert_eq!(b.push("\n\n"), "data: 3\n\n\n");
    assert!(b.at_boundary());
}

#[test]
fn comments_are_events_like_any_other() {
    let mut b = EventBoundary::new(Format::Sse);
    assert_eq!(b.push(": keep-alive\n\n: que"), ": keep-alive\n\n");
    assert_eq!(b.finish(), ": que");
}

#[test]
fn an_event_longer_than_the_cap_passes_as_it_comes_and_is_closed_on_failure() {
    let mut b = EventBoundary::new(Format::Sse);
    let long = format!("data: \"{}", "x".repeat(MAX_HELD));
    assert_eq!(b.push(&long[..100]), "");
    assert_eq!(b.push(&long[100..]), long);
    assert!(!b.at_boundary());
    assert_eq!(b.push("yy"), "yy");
    let cut = b.abandon();
    assert_eq!(cut.close, "\n\n");
    let out = format!("{long}yy{}{ERROR_EVENT}", cut.close);
    assert_eq!(
        sse_events(&out).last().map(String::as_str),
        Some(ERROR_DATA)
    );
}

#[test]
fn a_passed_long_event_ends_and_holding_resumes() {
    let mut b = EventBoundary::new(Format::Sse);
    let long = format!("data: {}", "x".repeat(MAX_HELD + 1));
    assert_eq!(b.push(&long), long);
    assert_eq!(b.push("x\n\ndata: {"), "x\n\n");
    assert_eq!(b.abandon().close, "");
}

#[test]
fn ndjson_lines_pass_whole_and_a_cut_line_is_withheld() {
    let mut b = EventBoundary::new(Format::Ndjson);
    assert!(matches!(
        b.push("{\"a\":1}\n"),
        Cow::Borrowed("{\"a\":1}\n")
    ));
    assert_eq!(b.push("{\"b\":2}\n{\"c\""), "{\"b\":2}\n");
    assert_eq!(b.push(":3}\n"), "{\"c\":3}\n");
    let out = fail_after(
        Format::Ndjson,
        &["{\"a\":1}\n{\"mes"],
        "{\"error\":\"x\"}\n",
    );
    assert_eq!(out, "{\"a\":1}\n{\"error\":\"x\"}\n");
}

#[test]
fn ndjson_over_the_cap_is_ended_with_a_newline_on_failure() {
    let mut b = EventBoundary::new(Format::Ndjson);
    let long = "x".repeat(MAX_HELD + 1);
    assert_eq!(b.push(&long), long);
    assert_eq!(b.abandon().close, "\n");
}

#[test]
fn format_follows_the_content_type() {
    assert_eq!(
        Format::for_content_type("application/x-ndjson"),
        Format::Ndjson
    );
    assert_eq!(Format::for_content_type("text/event-stream"), Format::Sse);
}

/// A small deterministic generator (xorshift), so the property tests need no crate.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// A stream of assorted events: plain, `\r\n` and `\r` line ends, Anthropic pairs,
/// comments, multi-line data, non-ASCII text.
fn random_stream(rng: &mut Rng) -> String {
    let mut s = String::new();
    for n in 0..rng.below(12) {
        let event = match rng.below(6) {
            0 => format!("data: {{\"n\":{n}}}\n\n"),
            1 => format!("data: {{\"n\":{n}}}\r\n\r\n"),
            2 => format!("event: delta\ndata: {{\"n\":{n},\"t\":\"héllo 🌍\"}}\n\n"),
            3 => ": ping\n\n".to_string(),
            4 => format!("data: {{\"n\":\ndata: {n}}}\n\n"),
            _ => format!("data: {{\"n\":{n}}}\r\r"),
        };
        s.push_str(&event);
    }
    s
}

/// `text` split at random character boundaries.
fn random_pieces<'a>(rng: &mut Rng, text: &'a str) -> Vec<&'a str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = (1 + rng.below(12)).min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        pieces.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    pieces
}

#[test]
fn any_split_and_any_cut_ends_with_the_complete_events_then_the_error() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..5_000 {
        let stream = random_stream(&mut rng);
        let mut cut = rng.below(stream.len() + 1);
        while !stream.is_char_boundary(cut) {
            cut -= 1;
        }
        let sent = &stream[..cut];
        let pieces = random_pieces(&mut rng, sent);
        let out = fail_after(Format::Sse, &pieces, ERROR_EVENT);
        let mut expected = sse_events(sent);
        expected.push(ERROR_DATA.to_string());
        assert_eq!(sse_events(&out), expected, "stream {sent:?} → {out:?}");
    }
}

#[test]
fn any_split_without_failure_passes_every_byte_in_order() {
    let mut rng = Rng(7);
    for _ in 0..5_000 {
        let stream = random_stream(&mut rng);
        let mut cut = rng.below(stream.len() + 1);
        while !stream.is_char_boundary(cut) {
            cut -= 1;
        }
        let sent = &stream[..cut];
        let mut b = EventBoundary::new(Format::Sse);
        let mut out = String::new();
        for piece in random_pieces(&mut rng, sent) {
            let ready = b.push(piece);
            out.push_str(&ready);
            // What went out so far is a prefix ending on an event end.
            assert!(
                sse_events(&format!("{out}{ERROR_EVENT}")).last() == Some(&ERROR_DATA.to_string()),
                "{out:?} does not end on an event boundary"
            );
        }
        out.push_str(&b.finish());
        assert_eq!(out, sent);
    }
}

#[test]
fn ndjson_any_split_and_cut_leaves_only_whole_lines() {
    let mut rng = Rng(42);
    for _ in 0..2_000 {
        let lines: String = (0..rng.below(8))
            .map(|n| format!("{{\"n\":{n},\"t\":\"héllo\"}}\n"))
            .collect();
        let mut cut = rng.below(lines.len() + 1);
        while !lines.is_char_boundary(cut) {
            cut -= 1;
        }
        let pieces = random_pieces(&mut rng, &lines[..cut]);
        let out = fail_after(Format::Ndjson, &pieces, "{\"error\":\"x\"}\n");
        let parsed: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("every line is JSON"))
            .collect();
        let whole = lines[..cut].matches('\n').count();
        assert_eq!(parsed.len(), whole + 1, "{out:?}");
        assert_eq!(parsed[whole]["error"], "x");
    }
}

#[test]
fn the_last_event_is_noticed_whole_and_only_at_a_line_start() {
    let mut b = EventBoundary::new(Format::Sse);
    b.push("data: {\"choices\":[{\"delta\":{\"content\":\"data: [DONE]\"}}]}\n\n");
    assert!(!b.ended(), "inside a JSON string it is text");
    b.push("data: [DO");
    assert!(!b.ended(), "not before its end arrives");
    b.push("NE]\n\n");
    assert!(b.ended());

    let mut a = EventBoundary::new(Format::Sse);
    a.push("event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    assert!(a.ended(), "Anthropic's message_stop");

    let mut n = EventBoundary::new(Format::Ndjson);
    n.push("{\"message\":{\"content\":\"\\\"done\\\":true\"},\"done\":false}\n");
    assert!(!n.ended(), "an escaped quote is not the key");
    n.push("{\"done\":true}\n");
    assert!(n.ended());
}
