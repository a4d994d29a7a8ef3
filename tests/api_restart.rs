//! The operator survives the API server restarting mid-run and converges afterwards.
//! (A test binary of its own: the restart would disturb other tests of the same binary.)

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

const T: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_across_an_api_server_restart() {
    let client = client().await;
    let ns = namespace(&client, "api-restart").await;
    let _op = Operator::on(&repo().join("rules"), &repo().join("templates"))
        .namespace(&ns)
        .flags(&["--install-crds"])
        .start()
        .await;
    let apps = api(&client, Some(&ns), "app.example.com/v1", "MyApp", "myapps");
    wait_for(T, "the MyApp CRD to be served", || async {
        apps.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
    let app = |i: usize| {
        let mut a = example("myapp.yaml", &ns);
        a["metadata"]["name"] = json!(format!("app-{i}"));
        a["spec"]["replicas"] = json!(1);
        a
    };
    for i in 0..20 {
        apply(&apps, app(i)).await;
    }
    // Mid-convergence: restart the API server (same ports, flags and data).
    let status = cluster_sh_command("restart-apiserver")
        .status()
        .expect("cluster.sh");
    assert!(status.success(), "restart-apiserver failed");
    let client = self::client().await;
    let apps = api(&client, Some(&ns), "app.example.com/v1", "MyApp", "myapps");
    // Changes made after the restart are seen too.
    for i in 20..30 {
        apply(&apps, app(i)).await;
    }
    let mut changed = app(0);
    changed["spec"]["replicas"] = json!(2);
    apply(&apps, changed).await;
    for i in 0..30 {
        wait_ready(&apps, &format!("app-{i}"), "True", Some("Ready"), T).await;
    }
    let a0 = wait_ready(&apps, "app-0", "True", Some("Ready"), T).await;
    assert_eq!(a0["status"]["availableReplicas"], 2);
}
