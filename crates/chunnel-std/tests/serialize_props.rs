//! Property tests of the serialization formats: arbitrary values round-trip exactly in both
//! formats, and decoding arbitrary (or corrupted) bytes never panics.

use std::collections::BTreeMap;

use chunnel_std::serialize::{Bincode, Format, Json};
use proptest::prelude::*;

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Record {
    id: u64,
    delta: i32,
    ratio: f64,
    flag: bool,
    letter: char,
    name: String,
    blob: Vec<u8>,
    pair: (u8, i16),
    labels: BTreeMap<String, u32>,
    parent: Option<Box<Record>>,
    events: Vec<Event>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
enum Event {
    Tick,
    Moved(i64, i64),
    Renamed { from: String, to: String },
    Batch(Vec<Option<u16>>),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        Just(Event::Tick),
        (any::<i64>(), any::<i64>()).prop_map(|(x, y)| Event::Moved(x, y)),
        (any::<String>(), any::<String>()).prop_map(|(from, to)| Event::Renamed { from, to }),
        prop::collection::vec(any::<Option<u16>>(), 0..8).prop_map(Event::Batch),
    ]
}

fn leaf() -> impl Strategy<Value = Record> {
    (
        (
            any::<u64>(),
            any::<i32>(),
            finite(),
            any::<bool>(),
            any::<char>(),
        ),
        (any::<String>(), prop::collection::vec(any::<u8>(), 0..64)),
        (
            any::<(u8, i16)>(),
            prop::collection::btree_map(any::<String>(), any::<u32>(), 0..4),
        ),
        prop::collection::vec(event(), 0..6),
    )
        .prop_map(
            |((id, delta, ratio, flag, letter), (name, blob), (pair, labels), events)| Record {
                id,
                delta,
                ratio,
                flag,
                letter,
                name,
                blob,
                pair,
                labels,
                parent: None,
                events,
            },
        )
}

/// Finite floats (JSON has no NaN or infinity), of every magnitude and sign.
fn finite() -> impl Strategy<Value = f64> {
    any::<f64>().prop_filter("finite", |f| f.is_finite())
}

fn record() -> impl Strategy<Value = Record> {
    leaf().prop_recursive(3, 8, 1, |inner| {
        (leaf(), inner).prop_map(|(mut r, p)| {
            r.parent = Some(Box::new(p));
            r
        })
    })
}

fn round_trip<F: Format>(r: &Record) -> Result<(), TestCaseError> {
    let bytes = F::to_bytes(r).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let back: Record = F::decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&back, r, "{} round trip", F::NAME);
    // Appending to a buffer gives the same bytes as `to_bytes`.
    let mut v = b"prefix".to_vec();
    F::encode(r, &mut v).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&v[6..], &bytes[..]);
    Ok(())
}

/// Whatever decodes re-encodes to bytes that decode to the same encoding again.
fn decode_never_panics<F: Format>(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(v) = F::decode::<Record>(bytes) {
        let once = F::to_bytes(&v).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let w: Record = F::decode(&once).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let twice = F::to_bytes(&w).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(once, twice);
    }
    let _ = F::decode::<Event>(bytes);
    let _ = F::decode::<Vec<String>>(bytes);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn values_round_trip_in_both_formats(r in record()) {
        round_trip::<Bincode>(&r)?;
        round_trip::<Json>(&r)?;
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        decode_never_panics::<Bincode>(&bytes)?;
        decode_never_panics::<Json>(&bytes)?;
    }

    #[test]
    fn corrupted_encodings_never_panic(
        r in record(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        for bytes in [Bincode::to_bytes(&r), Json::to_bytes(&r)] {
            let mut b = bytes.map_err(|e| TestCaseError::fail(e.to_string()))?.to_vec();
            for (at, v) in &edits {
                let i = at.index(b.len());
                b[i] = *v;
            }
            decode_never_panics::<Bincode>(&b)?;
            decode_never_panics::<Json>(&b)?;
            let end = cut.index(b.len() + 1);
            decode_never_panics::<Bincode>(&b[..end])?;
            decode_never_panics::<Json>(&b[..end])?;
        }
    }
}
