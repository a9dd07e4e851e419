//! Just enough of `multipart/form-data` to read a short text field (`model`, `stream`)
//! of an upload; the body itself is relayed untouched. Nothing is copied but the value,
//! and a value longer than [`MAX_VALUE`] counts as absent.

/// Longest field value read (a model name is at most 256 bytes).
const MAX_VALUE: usize = 1024;
/// Longest boundary RFC 2046 allows.
const MAX_BOUNDARY: usize = 70;

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    let kind = parts.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts.find_map(|p| {
        let (name, value) = p.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let value = value.trim().trim_matches('"');
        (!value.is_empty() && value.len() <= MAX_BOUNDARY).then(|| value.to_string())
    })
}

/// The text value of the form field `name` (not a file part), if the body has one.
pub fn field(body: &[u8], boundary: &str, name: &str) -> Option<String> {
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    let mut at = find(body, delimiter, 0)?;
    loop {
        let start = at + delimiter.len();
        // `--` after a delimiter ends the form.
        if body.get(start..start + 2) == Some(b"--") {
            return None;
        }
        let next = find(body, delimiter, start)?;
        let part = &body[start..next];
        if let Some(value) = value_of(part, name) {
            return Some(value);
        }
        at = next;
    }
}

/// A part's value when its headers name the field `name` and no file.
fn value_of(part: &[u8], name: &str) -> Option<String> {
    let head_end = find(part, b"\r\n\r\n", 0)?;
    let head = std::str::from_utf8(&part[..head_end]).ok()?;
    let disposition = head.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case("content-disposition")
            .then_some(v)
    })?;
    let mut named = false;
    for param in disposition.split(';').skip(1) {
        let Some((key, value)) = param.split_once('=') else {
            continue;
        };
        match key.trim() {
            "filename" | "filename*" => return None,
            "name" => named = value.trim().trim_matches('"') == name,
            _ => {}
        }
    }
    if !named {
        return None;
    }
    let value = &part[head_end + 4..];
    // The CRLF before the next delimiter belongs to the delimiter.
    let value = value.strip_suffix(b"\r\n").unwrap_or(value);
    if value.len() > MAX_VALUE {
        return None;
    }
    std::str::from_utf8(value)
        .ok()
        .map(|v| v.trim().to_string())
}

/// The first `needle` in `hay` at or after `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let first = *needle.first()?;
    let mut at = from;
    while at + needle.len() <= hay.len() {
        let skip = hay[at..].iter().position(|b| *b == first)?;
        at += skip;
        if hay.get(at..at + needle.len()) == Some(needle) {
            return Some(at);
        }
        at += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\x00\xff--Xy\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ\r\ncontent-disposition: form-data; name=stream\r\n\r\ntrue\r\n--XyZ--\r\n";

    #[test]
    fn reads_the_boundary() {
        assert_eq!(
            boundary("multipart/form-data; boundary=XyZ").as_deref(),
            Some("XyZ")
        );
        assert_eq!(
            boundary("Multipart/Form-Data;charset=utf-8; boundary=\"a b\"").as_deref(),
            Some("a b")
        );
        assert_eq!(boundary("application/json"), None);
        assert_eq!(boundary("multipart/form-data"), None);
    }

    #[test]
    fn finds_fields_past_a_file_part() {
        assert_eq!(field(FORM, "XyZ", "model").as_deref(), Some("whisper-1"));
        assert_eq!(field(FORM, "XyZ", "stream").as_deref(), Some("true"));
        // A file part is never a field, whatever its name.
        assert_eq!(field(FORM, "XyZ", "file"), None);
        assert_eq!(field(FORM, "XyZ", "language"), None);
        assert_eq!(field(FORM, "other", "model"), None);
    }

    #[test]
    fn truncated_or_odd_forms_have_no_field() {
        for cut in 0..FORM.len() {
            // Never panics; a field is found only when its part ended.
            let _ = field(&FORM[..cut], "XyZ", "model");
        }
        let long = format!(
            "--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{}\r\n--b--",
            "m".repeat(MAX_VALUE + 1)
        );
        assert_eq!(field(long.as_bytes(), "b", "model"), None);
    }
}
