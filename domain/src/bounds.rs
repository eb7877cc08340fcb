//! Bounds on the lists a request carries, enforced while the request is parsed: a list past
//! its bound is refused before its items are read, so no later step (a de-duplication, a
//! validation, a query) ever sees more than the bound. Use with
//! `#[serde(deserialize_with = "…")]` and state the same bound in the schema with
//! `#[schemars(length(max = N))]` (the OpenAPI document's `maxItems`).

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// `e`, naming `field`: a field of a `#[serde(flatten)]`ed struct reaches the request's
/// parser without its path, so its bound names it in the message ([`field_of`] reads it back).
pub fn in_field<E: de::Error>(field: &str, e: E) -> E {
    E::custom(format!("{FIELD_MARK}{field}`: {e}"))
}

/// The field and the message of an error made by [`in_field`].
pub fn field_of(message: &str) -> Option<(&str, &str)> {
    message.strip_prefix(FIELD_MARK)?.split_once("`: ")
}

const FIELD_MARK: &str = "in field `";

/// A list of at most `N` items.
pub fn list<'de, D, T, const N: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_seq(ListVisitor::<T, N>(PhantomData))
}

/// An optional list of at most `N` items (`null` or absent: none). Pair with
/// `#[serde(default)]`.
pub fn optional_list<'de, D, T, const N: usize>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_option(OptionVisitor::<T, N>(PhantomData))
}

/// A list of at most `N` strings, each at most `L` characters.
pub fn strings<'de, D, const N: usize, const L: usize>(d: D) -> Result<Vec<String>, D::Error>
where
    D: Deserializer<'de>,
{
    let items: Vec<String> = list::<D, String, N>(d)?;
    match items.iter().position(|s| s.chars().count() > L) {
        Some(i) => Err(de::Error::custom(format!(
            "item {i} is longer than {L} characters"
        ))),
        None => Ok(items),
    }
}

/// A map of at most `N` entries.
pub fn map<'de, D, V, const N: usize>(d: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    d.deserialize_map(MapVisitor::<V, N>(PhantomData))
}

/// An optional map of at most `N` entries. Pair with `#[serde(default)]`.
pub fn optional_map<'de, D, V, const N: usize>(
    d: D,
) -> Result<Option<BTreeMap<String, V>>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    Option::<Bounded<BTreeMap<String, V>, N>>::deserialize(d).map(|o| o.map(|b| b.0))
}

struct Bounded<T, const N: usize>(T);

impl<'de, V: Deserialize<'de>, const N: usize> Deserialize<'de>
    for Bounded<BTreeMap<String, V>, N>
{
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        map::<D, V, N>(d).map(Bounded)
    }
}

struct ListVisitor<T, const N: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for ListVisitor<T, N> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a list of at most {N} items")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(N));
        while let Some(item) = seq.next_element()? {
            if items.len() == N {
                return Err(de::Error::custom(format!("at most {N} items")));
            }
            items.push(item);
        }
        Ok(items)
    }
}

struct OptionVisitor<T, const N: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for OptionVisitor<T, N> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "null or a list of at most {N} items")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        list::<D, T, N>(d).map(Some)
    }
}

struct MapVisitor<V, const N: usize>(PhantomData<V>);

impl<'de, V: Deserialize<'de>, const N: usize> Visitor<'de> for MapVisitor<V, N> {
    type Value = BTreeMap<String, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an object of at most {N} entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut entries = BTreeMap::new();
        while let Some((k, v)) = access.next_entry::<String, V>()? {
            if entries.len() == N && !entries.contains_key(&k) {
                return Err(de::Error::custom(format!("at most {N} entries")));
            }
            entries.insert(k, v);
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use serde::{de, Deserialize};

    #[derive(Debug, Deserialize)]
    struct Request {
        #[serde(deserialize_with = "super::strings::<_, 3, 4>")]
        types: Vec<String>,
        #[serde(default, deserialize_with = "super::optional_list::<_, u8, 2>")]
        keys: Option<Vec<u8>>,
        #[serde(default, deserialize_with = "super::map::<_, u8, 1>")]
        labels: std::collections::BTreeMap<String, u8>,
    }

    #[test]
    fn a_named_refusal_reads_back() {
        let e: serde_json::Error = super::in_field("sshKeys", de::Error::custom("at most 2 items"));
        assert_eq!(
            super::field_of(&e.to_string()),
            Some(("sshKeys", "at most 2 items"))
        );
        assert_eq!(super::field_of("at most 2 items"), None);
    }

    fn parse(s: &str) -> Result<Request, String> {
        serde_json::from_str(s).map_err(|e| e.to_string())
    }

    #[test]
    fn lists_and_maps_past_their_bound_are_refused() {
        let ok = parse(r#"{"types": ["a", "abcd"], "keys": [1, 2], "labels": {"a": 1}}"#).unwrap();
        assert_eq!(ok.types, ["a", "abcd"]);
        assert_eq!(ok.keys, Some(vec![1, 2]));
        assert!(parse(r#"{"types": [], "keys": null}"#)
            .unwrap()
            .keys
            .is_none());
        assert!(parse(r#"{"types": []}"#).unwrap().keys.is_none());
        let too_many = parse(r#"{"types": ["a", "b", "c", "d"]}"#).unwrap_err();
        assert!(too_many.contains("at most 3 items"), "{too_many}");
        let too_long = parse(r#"{"types": ["abcde"]}"#).unwrap_err();
        assert!(too_long.contains("longer than 4"), "{too_long}");
        assert!(parse(r#"{"types": [], "keys": [1, 2, 3]}"#).is_err());
        assert!(parse(r#"{"types": [], "labels": {"a": 1, "b": 2}}"#).is_err());
        let one = parse(r#"{"types": [], "labels": {"a": 1, "a": 2}}"#).unwrap();
        assert_eq!(
            one.labels.get("a"),
            Some(&2),
            "a key given twice counts once"
        );
    }
}
