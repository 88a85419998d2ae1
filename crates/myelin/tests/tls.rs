//! TLS end to end, with curl as the client (a real TLS stack, h2 by ALPN): the real `myelin
//! serve` serving clients over HTTPS in front of a simulated engine that itself serves HTTPS, a
//! client or engine with a certificate from another CA refused, a certificate replaced on disk
//! serving the next connections, and the admin API and the metrics listener behind client
//! certificates. The test PKI is
//! `crates/myelin-http/tests/fixtures/tls` (its `make.sh` regenerates it).

mod support;

use std::path::PathBuf;
use std::process::Command;

use myelin_http::tls::ServerTlsFiles;
use myelin_sim::{ClusterConfig, SimCluster};
use serde_json::json;
use support::{Router, metric_value, wait_until};

fn tls_file(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../myelin-http/tests/fixtures/tls")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

fn engine(tls: bool) -> SimCluster {
    SimCluster::start(ClusterConfig {
        engines: 1,
        speedup: 50.0,
        tls: tls.then(|| ServerTlsFiles {
            cert: tls_file("server.pem").into(),
            key: tls_file("server.key").into(),
            client_ca: None,
        }),
        ..ClusterConfig::default()
    })
    .expect("simulated engine")
}

/// What curl said: its exit code, what `--write-out` printed, and the body.
struct Curl {
    code: i32,
    written: String,
    body: String,
}

/// Runs curl (silent, errors shown, 10 s at most) with `args`; the body goes to a file so that
/// `--write-out` stays apart.
fn curl(args: &[&str]) -> Curl {
    let body_file = std::env::temp_dir().join(format!(
        "myelin-tls-curl-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let output = Command::new("curl")
        .args(["-sS", "--max-time", "10", "-o"])
        .arg(&body_file)
        .args(args)
        .output()
        .expect("curl (the TLS tests use it as their client: install curl)");
    let body = std::fs::read_to_string(&body_file).unwrap_or_default();
    let _ = std::fs::remove_file(&body_file);
    Curl {
        code: output.status.code().unwrap_or(-1),
        written: String::from_utf8_lossy(&output.stdout).into_owned(),
        body,
    }
}

/// curl over TLS trusting the test CA and presenting the test client certificate, printing the
/// HTTP status.
fn curl_with_client_certificate(url: &str) -> Curl {
    curl(&[
        "--cacert",
        &tls_file("ca.pem"),
        "--cert",
        &tls_file("client.pem"),
        "--key",
        &tls_file("client.key"),
        "-w",
        "%{http_code}",
        url,
    ])
}

fn completion() -> String {
    json!({"model": myelin_sim::DEFAULT_MODEL_NAME, "prompt": "Hello over TLS", "max_tokens": 3})
        .to_string()
}

#[test]
fn clients_reach_the_router_over_https_by_h2_and_http1_and_the_router_reaches_an_https_engine() {
    let engine = engine(true);
    let url = &engine.engine_urls()[0];
    assert!(url.starts_with("https://"), "{url}");
    let (ca, cert, key) = (
        tls_file("ca.pem"),
        tls_file("server.pem"),
        tls_file("server.key"),
    );
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            url,
            "--engine-ca",
            &ca,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ],
    );
    let base = format!("https://127.0.0.1:{}", router.addr.port());
    let body = completion();
    for (version, expected) in [("--http1.1", "1.1"), ("--http2", "2")] {
        let answer = curl(&[
            version,
            "--cacert",
            &ca,
            "-w",
            "%{http_code} %{http_version}",
            "-H",
            "content-type: application/json",
            "-d",
            &body,
            &format!("{base}/v1/completions"),
        ]);
        assert_eq!(answer.code, 0, "curl {version}: {}", answer.written);
        assert_eq!(answer.written, format!("200 {expected}"), "{}", answer.body);
        let parsed: serde_json::Value = serde_json::from_str(&answer.body).expect("JSON body");
        assert!(
            parsed["choices"][0]["text"].is_string(),
            "the engine's answer, relayed: {parsed}"
        );
    }
    assert!(
        engine.counters()[0].prompt_tokens > 0,
        "the engine served both"
    );

    // A client that trusts another CA refuses the router's certificate (curl: 60).
    let refused = curl(&[
        "--cacert",
        &tls_file("other-ca.pem"),
        &format!("{base}/health"),
    ]);
    assert_eq!(refused.code, 60, "{}", refused.written);
    // Plain HTTP to the TLS port is a failed handshake: counted, the connection closed.
    let plain = curl(&[&format!("http://127.0.0.1:{}/health", router.addr.port())]);
    assert_ne!(plain.code, 0);
    wait_until("the failed handshakes are counted", || {
        metric_value(
            &router.metrics(),
            &[
                "myelin_tls_events_total",
                "listener=\"client\"",
                "event=\"handshake_failed\"",
            ],
        ) >= 2.0
    });
}

#[test]
fn an_engine_whose_certificate_the_router_does_not_trust_gets_no_request() {
    let engine = engine(true);
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.engine_urls()[0],
            "--engine-ca",
            &tls_file("other-ca.pem"),
            "--max-retries",
            "0",
        ],
    );
    let answer = router.post_json(
        "/v1/completions",
        &json!({"model": myelin_sim::DEFAULT_MODEL_NAME, "prompt": "hello", "max_tokens": 2}),
    );
    let status = answer.status;
    let error = answer.json();
    assert!(status == 502 || status == 503, "status {status}: {error}");
    assert!(error["error"]["message"].is_string(), "{error}");
    assert_eq!(
        engine.counters()[0].prompt_tokens,
        0,
        "the engine admitted a request"
    );
}

#[test]
fn a_certificate_replaced_on_disk_serves_the_next_connections() {
    let dir = std::env::temp_dir().join(format!("myelin-tls-renew-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::copy(tls_file("server.pem"), &cert).unwrap();
    std::fs::copy(tls_file("server.key"), &key).unwrap();
    let engine = engine(false);
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.engine_urls()[0],
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let health = format!("https://127.0.0.1:{}/health", router.addr.port());
    let (ca, other_ca) = (tls_file("ca.pem"), tls_file("other-ca.pem"));
    assert_eq!(curl(&["--cacert", &ca, &health]).code, 0);
    assert_eq!(curl(&["--cacert", &other_ca, &health]).code, 60);

    // Renewed as renewal tools do it: each file written beside and renamed into place.
    for (from, to) in [("other-server.key", &key), ("other-server.pem", &cert)] {
        let staged = dir.join("staged");
        std::fs::copy(tls_file(from), &staged).unwrap();
        std::fs::rename(&staged, to).unwrap();
    }
    wait_until("the renewed certificate serves new connections", || {
        curl(&["--cacert", &other_ca, &health]).code == 0
    });
    assert_eq!(curl(&["--cacert", &ca, &health]).code, 60);
    let metrics = router.metrics();
    let reloads = ["myelin_tls_events_total", "listener=\"client\""];
    assert!(metric_value(&metrics, &[reloads[0], reloads[1], "event=\"reloaded\""]) >= 1.0);

    // A broken file is not taken: the last good certificate stays in use, the failure counted.
    std::fs::write(&cert, "not a certificate").unwrap();
    wait_until("the failed reload is counted", || {
        curl(&["--cacert", &other_ca, &health]).code == 0
            && metric_value(
                &router.metrics(),
                &[reloads[0], reloads[1], "event=\"reload_failed\""],
            ) >= 1.0
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_admin_api_over_tls_wants_a_client_certificate_from_its_ca() {
    let engine = engine(false);
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.engine_urls()[0],
            "--admin-tls-cert",
            &tls_file("server.pem"),
            "--admin-tls-key",
            &tls_file("server.key"),
            "--admin-client-ca",
            &tls_file("ca.pem"),
        ],
    );
    let backends = format!(
        "https://127.0.0.1:{}/admin/backends",
        router.admin_addr().port()
    );
    let ca = tls_file("ca.pem");
    let anonymous = curl(&["--cacert", &ca, "-w", "%{http_code}", &backends]);
    assert_ne!(
        anonymous.code, 0,
        "no client certificate: {}",
        anonymous.written
    );
    let stranger = curl(&[
        "--cacert",
        &ca,
        "--cert",
        &tls_file("other-server.pem"),
        "--key",
        &tls_file("other-server.key"),
        &backends,
    ]);
    assert_ne!(stranger.code, 0, "a certificate of another CA");
    let admitted = curl_with_client_certificate(&backends);
    assert_eq!((admitted.code, admitted.written.as_str()), (0, "200"));
    let listing: serde_json::Value = serde_json::from_str(&admitted.body).expect("JSON");
    assert_eq!(listing["backends"].as_array().map(Vec::len), Some(1));
}

#[test]
fn the_metrics_listener_over_tls_serves_scrapers_with_a_certificate_from_its_ca() {
    let engine = engine(false);
    let metrics_listen = support::engine::free_loopback_addr().to_string();
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.engine_urls()[0],
            "--metrics-listen",
            &metrics_listen,
            "--metrics-tls-cert",
            &tls_file("server.pem"),
            "--metrics-tls-key",
            &tls_file("server.key"),
            "--metrics-client-ca",
            &tls_file("ca.pem"),
        ],
    );
    let https = format!("https://{metrics_listen}/metrics");
    let ca = tls_file("ca.pem");
    let anonymous = curl(&["--cacert", &ca, &https]);
    assert_ne!(anonymous.code, 0, "a scraper without a client certificate");
    let plain = curl(&[&format!("http://{metrics_listen}/metrics")]);
    assert!(
        !plain.body.contains("myelin_"),
        "plain HTTP to the TLS port: {}",
        plain.body
    );
    let scraper = curl_with_client_certificate(&https);
    assert_eq!((scraper.code, scraper.written.as_str()), (0, "200"));
    assert!(
        scraper
            .body
            .contains("myelin_router_residency_route_downgrades_total"),
        "{}",
        scraper.body
    );
    // The refused handshakes are counted under the metrics listener.
    wait_until("the metrics listener's failed handshakes counted", || {
        metric_value(
            &router.metrics(),
            &[
                "myelin_tls_events_total",
                "listener=\"metrics\"",
                "event=\"handshake_failed\"",
            ],
        ) >= 1.0
    });
}
