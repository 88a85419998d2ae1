//! `myelin sim`: N simulated vLLM engines in one process on consecutive ports, with optional
//! KV events, until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use myelin_kv_events::WireVersion;

use crate::cluster::{ClusterConfig, DEFAULT_MODEL_NAME, KvEventsConfig, SimCluster};
use crate::engine::{DEFAULT_BLOCK_SIZE, DEFAULT_NUM_GPU_BLOCKS, EngineConfig};
use crate::faults::FaultConfig;
use crate::perf::{A100_LLAMA_8B_PROFILE, A100Llama8B, profile_by_name};
use crate::publisher::DEFAULT_BUFFER_STEPS;

/// How often the foreground thread checks for a stop signal.
const SIGNAL_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Run simulated vLLM engines (OpenAI API, vLLM scheduler and prefix cache, vLLM KV events).
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Number of engines; engine i listens on PORT+i.
    #[arg(long, default_value_t = 1)]
    pub engines: usize,
    /// HOST:PORT of engine 0.
    #[arg(long, default_value = "127.0.0.1:8001")]
    pub listen: SocketAddr,
    /// Publish KV events: engine i on tcp://HOST:P+2i, replay on tcp://HOST:P+2i+1.
    #[arg(long, value_name = "P")]
    pub kv_events_base_port: Option<u16>,
    /// Interface the KV-event sockets bind (`*` = all).
    #[arg(long, default_value = "*")]
    pub kv_events_host: String,
    /// vLLM release whose KV-event byte layout to publish: 0.22 (tagged arrays) or 0.33 (maps).
    #[arg(long, default_value = "0.33", value_name = "VERSION")]
    pub vllm_wire: WireVersion,
    /// Topic frame of every KV-event message.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Batches kept for replay (vLLM's buffer_steps).
    #[arg(long, default_value_t = DEFAULT_BUFFER_STEPS)]
    pub kv_events_buffer_steps: usize,
    /// Divide every simulated duration by X (X > 1 runs faster than real hardware).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub speedup: f64,
    /// Performance profile: a100-40gb-llama-3.1-8b, dynamo-mocker-h100 or vllm-cpu-tiny-llama
    /// (vLLM's CPU build serving the test model of scripts/test-vllm).
    #[arg(long, default_value = A100_LLAMA_8B_PROFILE)]
    pub profile: String,
    /// KV cache capacity per engine, in blocks.
    #[arg(long, default_value_t = DEFAULT_NUM_GPU_BLOCKS, value_name = "N")]
    pub kv_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Token budget of one scheduler step [default: vLLM's for the profile's GPU: 2048 on an
    /// A100, 8192 on an H100].
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Running sequences at most [default: vLLM's for the profile's GPU: 256 on an A100, 1024
    /// on an H100].
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Context length, capped by the KV capacity [default: the profile model's, 131072].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Model name served.
    #[arg(long, default_value = DEFAULT_MODEL_NAME)]
    pub served_model_name: String,
    /// A LoRA adapter served besides the model (repeatable): `GET /v1/models` lists it with
    /// the model as parent, as vLLM does; a request naming it is cached apart from the base
    /// model's, and its KV events carry its name.
    #[arg(long = "lora-adapter", value_name = "NAME")]
    pub lora_adapters: Vec<String>,
    /// tokenizer.json (default: the bundled DeepSeek-V3 tokenizer, as `myelin serve`).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Chat template: a tokenizer_config.json or a Jinja file (default: ChatML).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Executor threads hosting the engines (0 = one per engine up to the cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Fault: answer 503 to every generation request after the first N (per engine).
    #[arg(long, value_name = "N")]
    pub fault_fail_after: Option<u64>,
    /// Fault: never answer generation requests after the first N (per engine).
    #[arg(long, value_name = "N")]
    pub fault_stall_after: Option<u64>,
    /// Fault: cut responses after their first token, after the first N requests (per engine).
    #[arg(long, value_name = "N")]
    pub fault_die_mid_stream_after: Option<u64>,
    /// Fault: do not send every Nth KV-event batch (it stays replayable): sequence gaps.
    #[arg(long, value_name = "N")]
    pub fault_kv_drop_every: Option<u64>,
    /// Fault: restart the KV publisher (seq back to 0) every N batches.
    #[arg(long, value_name = "N")]
    pub fault_kv_restart_every: Option<u64>,
    /// Serve no Prometheus metrics (`GET /metrics` answers 404), like TensorRT-LLM or Ollama.
    #[arg(long)]
    pub no_metrics: bool,
    /// Serve HTTPS with this PEM certificate chain (needs --tls-key), as an engine behind a
    /// TLS terminator would.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl SimArgs {
    /// The cluster these arguments describe.
    pub fn cluster_config(&self) -> ClusterConfig {
        // An unknown profile is refused by `SimCluster::start`; its limits do not matter.
        let defaults = match profile_by_name(&self.profile) {
            Some(profile) => EngineConfig::for_profile(profile.as_ref()),
            None => EngineConfig::for_profile(&A100Llama8B),
        };
        ClusterConfig {
            engines: self.engines,
            listen_host: self.listen.ip(),
            base_port: self.listen.port(),
            profile: self.profile.clone(),
            speedup: self.speedup,
            engine: EngineConfig {
                block_size: self.block_size,
                num_gpu_blocks: self.kv_blocks,
                max_num_batched_tokens: self
                    .max_num_batched_tokens
                    .unwrap_or(defaults.max_num_batched_tokens),
                max_num_seqs: self.max_num_seqs.unwrap_or(defaults.max_num_seqs),
                max_model_len: self.max_model_len.unwrap_or(defaults.max_model_len),
            },
            kv_events: self.kv_events_base_port.map(|base_port| KvEventsConfig {
                base_port,
                bind_host: self.kv_events_host.clone(),
                topic: self.kv_events_topic.clone(),
                wire: self.vllm_wire,
                buffer_steps: self.kv_events_buffer_steps,
            }),
            faults: FaultConfig {
                fail_after: self.fault_fail_after,
                stall_after: self.fault_stall_after,
                die_mid_stream_after: self.fault_die_mid_stream_after,
                kv_drop_every: self.fault_kv_drop_every,
                kv_restart_every: self.fault_kv_restart_every,
                no_metrics: self.no_metrics,
            },
            model_name: self.served_model_name.clone(),
            lora_adapters: self.lora_adapters.clone(),
            tokenizer_path: self.tokenizer.clone(),
            chat_template_path: self.chat_template.clone(),
            executor_threads: self.threads,
            tls: self
                .tls_cert
                .clone()
                .zip(self.tls_key.clone())
                .map(|(cert, key)| myelin_http::tls::ServerTlsFiles {
                    cert,
                    key,
                    client_ca: None,
                }),
        }
    }
}

/// Runs `myelin sim` until SIGINT or SIGTERM.
pub fn run(args: SimArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    let config = args.cluster_config();
    let cluster = SimCluster::start(config)?;
    let urls = cluster.engine_urls();
    for (index, url) in urls.iter().enumerate() {
        match cluster
            .kv_event_endpoints()
            .get(index)
            .and_then(Option::as_ref)
        {
            Some(endpoints) => println!(
                "engine {index}: {url} kv-events {} replay {} (vllm wire {})",
                endpoints.publish, endpoints.replay, args.vllm_wire
            ),
            None => println!("engine {index}: {url}"),
        }
    }
    eprintln!(
        "myelin sim: {} engine(s), profile {}, speedup {}, {} KV blocks of {} tokens each; \
         Ctrl-C to stop",
        args.engines, args.profile, args.speedup, args.kv_blocks, args.block_size
    );
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(SIGNAL_POLL_INTERVAL);
    }
    cluster.shutdown();
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        sim: SimArgs,
    }

    #[test]
    fn flags_map_onto_the_cluster_config() {
        let command = Command::try_parse_from([
            "sim",
            "--engines",
            "3",
            "--listen",
            "0.0.0.0:9000",
            "--kv-events-base-port",
            "6000",
            "--vllm-wire",
            "0.22",
            "--kv-events-topic",
            "kv",
            "--speedup",
            "4",
            "--kv-blocks",
            "900",
            "--fault-kv-drop-every",
            "7",
        ])
        .expect("flags parse");
        let config = command.sim.cluster_config();
        assert_eq!(config.engines, 3);
        assert_eq!(config.base_port, 9000);
        assert_eq!(config.engine.num_gpu_blocks, 900);
        assert_eq!(config.speedup, 4.0);
        assert_eq!(config.faults.kv_drop_every, Some(7));
        let kv = config.kv_events.expect("KV events on");
        assert_eq!(kv.base_port, 6000);
        assert_eq!(kv.wire, WireVersion::V0_22);
        assert_eq!(kv.topic, "kv");
        assert_eq!(kv.bind_host, "*");
        assert!(Command::try_parse_from(["sim", "--vllm-wire", "0.9"]).is_err());
        // The scheduler limits follow the profile unless a flag sets them.
        assert_eq!(config.engine.max_num_batched_tokens, 2048);
        assert_eq!(config.engine.max_num_seqs, 256);
        let h100 = Command::try_parse_from(["sim", "--profile", "dynamo-mocker-h100"])
            .expect("flags parse")
            .sim
            .cluster_config();
        assert_eq!(
            (h100.engine.max_num_batched_tokens, h100.engine.max_num_seqs),
            (8192, 1024)
        );
        let set = Command::try_parse_from([
            "sim",
            "--profile",
            "dynamo-mocker-h100",
            "--max-num-batched-tokens",
            "512",
        ])
        .expect("flags parse")
        .sim
        .cluster_config();
        assert_eq!(
            (set.engine.max_num_batched_tokens, set.engine.max_num_seqs),
            (512, 1024)
        );
    }
}
