//! The YCSB generator against a real store: the load phase inserts every record, and a short
//! open-loop run answers every request in both sharding modes.

use std::rc::Rc;
use std::time::Duration;

use chunnel_kv::ycsb::{self, KeyDist, OpGen, RunConfig, Workload};
use chunnel_kv::{ClientConfig, KvClient, KvServer, Offer, ServerConfig};

#[tokio::test(flavor = "current_thread")]
async fn load_then_open_loop_run() {
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async {
            let server = KvServer::start("127.0.0.1:0".parse().unwrap(), ServerConfig::new(2))
                .await
                .unwrap();
            let records = 500;
            for (i, offer) in [Offer::ClientPush, Offer::ServerSide]
                .into_iter()
                .enumerate()
            {
                let client = Rc::new(
                    KvClient::connect(server.addr(), ClientConfig::default().with_offer(offer))
                        .await
                        .unwrap(),
                );
                if i == 0 {
                    ycsb::load(&*client, records, 16, 8).await.unwrap();
                    for k in [0, records / 2, records - 1] {
                        let v = client.get(&ycsb::key(k)).await.unwrap();
                        assert_eq!(v, Some(ycsb::value(k, 16)));
                    }
                }
                let ops = OpGen::new(Workload::A, KeyDist::zipfian(records), 16, 9);
                let cfg = RunConfig::new(
                    2000.0,
                    Duration::from_millis(50),
                    Duration::from_millis(200),
                );
                let s = ycsb::run(Rc::clone(&client), ops, &cfg).await;
                assert!(s.scheduled > 100, "{s:?}");
                assert!(s.clean(), "{s:?}");
                assert_eq!(s.completed, s.scheduled);
                assert_eq!(s.hist.len(), s.completed);
                assert!(s.quantile_us(0.5) > 0.0);
            }
        })
        .await;
}

/// The same seeded YCSB run (load, then workload A with zipfian keys) against a client-push
/// store and a server-side-sharding store gives the same answer to every request.
#[tokio::test(flavor = "current_thread")]
async fn client_push_and_server_side_answer_the_same_ycsb_run() {
    let records = 400;
    let mut answers = Vec::new();
    for offer in [Offer::ClientPush, Offer::ServerSide] {
        let server = KvServer::start("127.0.0.1:0".parse().unwrap(), ServerConfig::new(3))
            .await
            .unwrap();
        let client = KvClient::connect(server.addr(), ClientConfig::default().with_offer(offer))
            .await
            .unwrap();
        ycsb::load(&client, records, 16, 8).await.unwrap();
        let mut ops = OpGen::new(Workload::A, KeyDist::zipfian(records), 16, 42);
        let mut got = Vec::with_capacity(3000);
        for _ in 0..3000 {
            got.push(client.call(ops.next_op()).await.unwrap());
        }
        answers.push(got);
    }
    assert_eq!(answers[0].len(), 3000);
    assert!(
        answers[0].iter().filter(|a| a.is_some()).count() > 2500,
        "reads and updates of loaded keys return values"
    );
    assert_eq!(
        answers[0], answers[1],
        "the two sharding modes answered differently"
    );
}
