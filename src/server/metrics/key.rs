//! Counting by (route, model, status class) without copying three names for every
//! request: the map's owned keys are found by borrowed ones, and a key is copied only
//! the first time it is seen. (`BTreeMap` finds a key by any type it `Borrow`s as; a
//! tuple of `String`s cannot borrow as a tuple of `&str`, but it can as a trait object
//! both kinds of tuple implement.)

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// (route, model, status class), as kept.
pub type Triple = (String, String, String);

/// A (route, model, class) key, owned or borrowed.
pub trait Key3 {
    fn parts(&self) -> (&str, &str, &str);
}

impl Key3 for Triple {
    fn parts(&self) -> (&str, &str, &str) {
        (&self.0, &self.1, &self.2)
    }
}

impl Key3 for (&str, &str, &str) {
    fn parts(&self) -> (&str, &str, &str) {
        *self
    }
}

impl<'a> Borrow<dyn Key3 + 'a> for Triple {
    fn borrow(&self) -> &(dyn Key3 + 'a) {
        self
    }
}

// The order of the parts, as `Triple`'s own (tuples compare field by field): what
// `Borrow` requires of a key found through it.
impl PartialEq for dyn Key3 + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn Key3 + '_ {}

impl PartialOrd for dyn Key3 + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for dyn Key3 + '_ {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

/// Adds one to the count of (route, model, class).
pub fn bump(map: &mut BTreeMap<Triple, u64>, route: &str, model: &str, class: &str) {
    let probe = (route, model, class);
    match map.get_mut(&probe as &dyn Key3) {
        Some(n) => *n += 1,
        None => {
            map.insert((route.into(), model.into(), class.into()), 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_counted_in_place_and_kept_in_order() {
        let mut map = BTreeMap::new();
        bump(&mut map, "/b", "m", "2xx");
        bump(&mut map, "/a", "m", "5xx");
        bump(&mut map, "/b", "m", "2xx");
        bump(&mut map, "/a", "m", "2xx");
        let seen: Vec<_> = map
            .iter()
            .map(|((r, m, c), n)| (r.as_str(), m.as_str(), c.as_str(), *n))
            .collect();
        assert_eq!(
            seen,
            [
                ("/a", "m", "2xx", 1),
                ("/a", "m", "5xx", 1),
                ("/b", "m", "2xx", 2)
            ]
        );
    }
}
