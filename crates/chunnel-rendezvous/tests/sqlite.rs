//! The SQLite backend against the store semantics every backend must have.

use chunnel_rendezvous::SqliteStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_semantics() {
    let dir = std::env::temp_dir().join(format!("chunnel-rdv-sqlite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = SqliteStore::open(dir.join("groups.sqlite")).unwrap();
    chunnel_rendezvous::conformance::store_semantics(&store, "conf").await;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
