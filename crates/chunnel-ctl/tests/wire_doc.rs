//! Keeps docs/wire.md §17 honest: every JSON line of the section is decoded by the reference
//! decoder (requests) or decodes and encodes back to the same bytes (responses).

use chunnel_ctl::proto::{Response, encode_request, encode_response, parse_request};

const DOC: &str = include_str!("../../../docs/wire.md");

#[test]
fn section_17_examples_decode() {
    let start = DOC
        .find("## 17. The control protocol")
        .expect("docs/wire.md has §17");
    let section = &DOC[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let (mut requests, mut responses) = (0, 0);
    let mut in_json = false;
    for line in section.lines() {
        match line {
            "```json" => in_json = true,
            "```" => in_json = false,
            l if in_json => {
                if l.contains("\"op\"") {
                    let op = parse_request(l.as_bytes())
                        .unwrap_or_else(|e| panic!("§17 request {l}: {e:?}"));
                    let again = encode_request(&op);
                    assert_eq!(parse_request(&again[..again.len() - 1]), Ok(op));
                    requests += 1;
                } else {
                    let r: Response =
                        serde_json::from_str(l).unwrap_or_else(|e| panic!("§17 response {l}: {e}"));
                    let again = encode_response(&r);
                    assert_eq!(std::str::from_utf8(&again).unwrap(), format!("{l}\n"));
                    responses += 1;
                }
            }
            _ => {}
        }
    }
    assert!(
        requests >= 10 && responses >= 5,
        "{requests} requests, {responses} responses"
    );
}
