//! The counting allocator counts: an allocation moves the count, so a no-allocation test that
//! reads it can fail.

#[global_allocator]
static A: chunnel_test::alloc::Counting = chunnel_test::alloc::Counting::new();

#[test]
fn an_allocation_and_a_reallocation_are_counted() {
    let before = A.count();
    let mut v: Vec<u8> = Vec::with_capacity(16);
    v.extend_from_slice(&[0; 64]);
    std::hint::black_box(&v);
    assert!(A.count() - before >= 2, "{} counted", A.count() - before);
}
