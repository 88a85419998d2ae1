//! `--sim N`: simulated vLLM engines (crates/myelin-sim) started in-process as the router's
//! backends, with the router's tokenizer and chat template so both count the same tokens.

use std::path::Path;

use myelin_sim::{ClusterConfig, KvEventsConfig, SimCluster};

use crate::backend_spec::BackendSpec;

/// Simulated engines, running for as long as this value lives.
pub struct SimEngines {
    cluster: SimCluster,
}

impl SimEngines {
    /// Starts `count` engines on ephemeral loopback ports (`tokenizer_path` `None`: the
    /// bundled tokenizer).
    pub fn start(
        count: usize,
        speedup: f64,
        tokenizer_path: Option<&Path>,
        chat_template_path: Option<&Path>,
    ) -> Result<SimEngines, myelin_sim::SimError> {
        let cluster = SimCluster::start(ClusterConfig {
            engines: count,
            speedup,
            tokenizer_path: tokenizer_path.map(Path::to_path_buf),
            chat_template_path: chat_template_path.map(Path::to_path_buf),
            // The engines publish KV events, which the router follows (residency `verified`
            // and `auto` then have a block-exact mirror, as with real vLLM).
            kv_events: Some(KvEventsConfig::default()),
            ..ClusterConfig::default()
        })?;
        Ok(SimEngines { cluster })
    }

    /// The engines as backends, with their KV-event endpoints.
    pub fn backend_specs(&self) -> Vec<BackendSpec> {
        let events = self.cluster.kv_event_endpoints();
        self.cluster
            .engine_urls()
            .iter()
            .enumerate()
            .filter_map(|(engine, url)| {
                let endpoints = events.get(engine).and_then(Option::as_ref);
                BackendSpec::from_parts(
                    url,
                    url,
                    endpoints.map(|endpoints| endpoints.publish.clone()),
                    endpoints.map(|endpoints| endpoints.replay.clone()),
                )
                .ok()
            })
            .collect()
    }
}
