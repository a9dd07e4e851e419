//! Ollama's `created_at` and `expires_at`: RFC 3339 UTC with milliseconds, from Unix
//! milliseconds (civil-from-days, no calendar crate).

/// `unix_ms` as RFC 3339 UTC with milliseconds, e.g. "2024-05-01T12:34:56.789Z",
/// for `created_at`.
pub fn rfc3339(unix_ms: u64) -> String {
    const MS_PER_DAY: u64 = 86_400_000;
    let (year, month, day) = civil_from_days(unix_ms / MS_PER_DAY);
    let ms = unix_ms % MS_PER_DAY;
    let secs = ms / 1000;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        ms % 1000
    )
}

/// (year, month, day) of a day count since 1970-01-01, by Howard Hinnant's
/// `civil_from_days` (proleptic Gregorian, eras of 400 years), unsigned since the
/// input never precedes the epoch.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}
