//! The residency estimate end to end: the control core scrapes the engines' KV capacity, the
//! data cores count admitted tokens and learn from the engines' reuse reports, and
//! GET /admin/backends shows it all.

mod support;

use serde_json::json;
use support::engine::{Behavior, Engine};
use support::{Router, metric_value, wait_until};

/// Sum of `field` over a backend's per-core `residency_estimate` entries.
fn per_core_sum(backend: &serde_json::Value, field: &str) -> u64 {
    backend["residency_estimate"]
        .as_array()
        .map(|cores| cores.iter().filter_map(|core| core[field].as_u64()).sum())
        .unwrap_or(0)
}

#[test]
fn simulated_engines_report_their_capacity_and_reuse() {
    // One data core: the second request must see the first one's route and its end at once (on
    // two cores a request that ended moments ago can still weigh in the other core's view).
    let router = Router::start_with_shards(1, &["--sim", "2", "--residency", "estimate"]);
    // The simulated engines publish vLLM's cache_config_info: 1 capacity for the estimate.
    let mut listing = json!(null);
    wait_until("the capacity scrape", || {
        listing = router.admin("GET", "/admin/backends", None).json();
        listing["backends"].as_array().is_some_and(|backends| {
            backends.iter().all(|backend| {
                backend["kv_capacity_tokens_reported"]
                    .as_u64()
                    .is_some_and(|c| c > 0)
                    && backend["residency_estimate"]
                        .as_array()
                        .is_some_and(|cores| {
                            cores.iter().all(|core| {
                                core["effective_capacity_tokens"]
                                    == backend["kv_capacity_tokens_reported"]
                            })
                        })
            })
        })
    });
    for backend in listing["backends"].as_array().unwrap() {
        assert!(backend["kv_utilization"].as_f64().is_some(), "{backend}");
        assert_eq!(backend["admitted_tokens"], 0, "{backend}");
    }
    let prompt: Vec<u32> = (0..256).map(|token| 500 + token).collect();
    let mut chosen = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let response = router.post_json(
            "/v1/completions",
            &json!({"model": myelin_sim::DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 4}),
        );
        assert_eq!(response.status, 200);
        chosen.insert(response.header("x-myelin-backend").unwrap().to_string());
    }
    assert_eq!(chosen.len(), 1, "a fresh prefix stays where it went");
    let id: u64 = chosen.into_iter().next().unwrap().parse().unwrap();
    wait_until("the reuse reports", || {
        listing = router.admin("GET", "/admin/backends", None).json();
        let backend = &listing["backends"][id as usize];
        per_core_sum(backend, "reuse_reports") == 4
    });
    let backend = &listing["backends"][id as usize];
    // 256 prompt tokens + 4 expected output tokens the first time; then the output and what
    // the engine reports it had to prefill again (its last block: an engine computes at least
    // a prompt's last token), or the whole prompt again when the deciding core had not yet
    // heard of the first route (replicas learn by message).
    let admitted = backend["admitted_tokens"].as_u64().unwrap();
    assert!(
        (256 + 4..=4 * (256 + 4 + 16)).contains(&admitted),
        "{backend}"
    );
    let metrics = router.metrics();
    assert_eq!(
        metric_value(
            &metrics,
            &["myelin_residency_reuse_reports_total", "as_history"]
        ),
        4.0
    );
    assert_eq!(
        metric_value(
            &metrics,
            &["myelin_residency_predicted_vs_reported_tokens_count"]
        ),
        4.0
    );
}

#[test]
fn a_configured_capacity_applies_when_the_engine_reports_none() {
    let engine = Engine::start(
        "plain",
        Behavior::Normal {
            chunks: 1,
            interval: std::time::Duration::ZERO,
        },
    );
    let spec = format!("{},capacity-tokens=5000", engine.url());
    let router = Router::start(&["--backend", &spec, "--residency", "estimate"]);
    let listing = router.admin("GET", "/admin/backends", None).json();
    let backend = &listing["backends"][0];
    assert_eq!(backend["capacity_tokens_configured"], 5000, "{backend}");
    for core in backend["residency_estimate"].as_array().unwrap() {
        assert_eq!(core["effective_capacity_tokens"], 5000, "{backend}");
        assert_eq!(core["correction"], 1.0);
    }
}
