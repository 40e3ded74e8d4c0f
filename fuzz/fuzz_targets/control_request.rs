//! A control-endpoint request line (chunnel-ctl's JSON-lines protocol, docs/wire.md §17) from
//! arbitrary bytes: `parse_request` returns an operation or a typed error, never a panic, and
//! refuses anything over its length limit.
#![no_main]

use chunnel_ctl::proto::{Code, parse_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse_request(data) {
        Ok(op) => {
            // What decodes re-encodes, and the encoding decodes to the same operation.
            let mut v = serde_json::to_value(&op).expect("an operation encodes");
            v.as_object_mut()
                .expect("an operation is an object")
                .insert("v".into(), chunnel_ctl::proto::VERSION.into());
            let again = parse_request(v.to_string().as_bytes()).expect("its encoding decodes");
            assert_eq!(again, op);
        }
        Err(e) => {
            if data.len() > chunnel_ctl::proto::MAX_REQUEST {
                assert_eq!(e.code, Code::TooLong);
            }
        }
    }
});
