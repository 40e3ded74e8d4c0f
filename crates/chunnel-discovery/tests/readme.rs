//! The README's discovery example is `examples/qos.rs` (which `cargo test` builds and the
//! `qos` example runs; the README block also runs as a doctest of chunnel-negotiate): the two
//! must not drift apart.

#[test]
fn readme_example_is_the_qos_example() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{dir}/../../README.md")).unwrap();
    let example = std::fs::read_to_string(format!("{dir}/examples/qos.rs")).unwrap();
    let body = &example[example.find("use bytes::Bytes;").unwrap()..];
    let section = &readme[readme
        .find("## Choosing implementations: discovery and QoS hints")
        .expect("the README section")..];
    let block = &section[section.find("```rust\n").unwrap() + 8..];
    let block = &block[..block.find("```").unwrap()];
    assert_eq!(block, body, "README and examples/qos.rs differ");
}
