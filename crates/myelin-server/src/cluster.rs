//! Configuration of the peer cluster (`--gossip-listen`, `--peer`, `--node-id`,
//! `--cluster-key-file`): several myelin nodes in front of the same engines sharing load,
//! residency inputs and routes over authenticated UDP gossip (docs/gossip-protocol.md). The
//! control core runs it (`control/gossip.rs`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use myelin_gossip::ClusterKey;

/// Default probe period of the membership's failure detector.
pub const DEFAULT_PROBE_INTERVAL_MS: u64 = 500;

/// The cluster's command-line flags (each also a `MYELIN_*` variable and a config-file key).
#[derive(Debug, Clone, clap::Args)]
pub struct GossipArgs {
    /// UDP address this node's peer gossip listens on; turns the peer cluster on (needs
    /// --cluster-key-file). [default: none: a single router]
    #[arg(long, env = "MYELIN_GOSSIP_LISTEN", value_name = "HOST:PORT")]
    pub gossip_listen: Option<SocketAddr>,

    /// Address the other nodes reach this node's gossip at, when --gossip-listen is a wildcard
    /// address (0.0.0.0 or ::). [default: --gossip-listen]
    #[arg(long, env = "MYELIN_GOSSIP_ADVERTISE", value_name = "HOST:PORT")]
    pub gossip_advertise: Option<SocketAddr>,

    /// Gossip address of another node to join the cluster through (repeatable; in MYELIN_PEER
    /// separate them with `;`). A node keeps announcing itself to them until it has joined.
    /// [default: none: others join this node]
    #[arg(
        long = "peer",
        alias = "peers",
        env = "MYELIN_PEER",
        value_name = "HOST:PORT",
        value_delimiter = ';'
    )]
    pub peers: Vec<SocketAddr>,

    /// This node's name in the cluster (unique; /admin/cluster shows it).
    /// [default: the gossip address]
    #[arg(long, env = "MYELIN_NODE_ID", value_name = "NAME")]
    pub node_id: Option<String>,

    /// File holding the cluster key (at least 16 bytes; surrounding whitespace ignored): every
    /// gossip packet is authenticated with HMAC-SHA256 under it. Required with --gossip-listen.
    #[arg(long, env = "MYELIN_CLUSTER_KEY_FILE", value_name = "PATH")]
    pub cluster_key_file: Option<PathBuf>,

    /// Probe period of the membership's failure detector: a dead node is declared down within
    /// about (members + 1) periods plus 3 periods of suspicion.
    #[arg(long, env = "MYELIN_GOSSIP_PROBE_INTERVAL_MS", value_name = "MS",
          default_value_t = DEFAULT_PROBE_INTERVAL_MS,
          value_parser = clap::value_parser!(u64).range(10..))]
    pub gossip_probe_interval_ms: u64,

    /// Most members (up, suspect or down; a down one is forgotten after a minute) this
    /// node's membership holds: gossip naming more is dropped (`reason="member_cap"`), so a
    /// peer holding the key cannot make it probe and send state to any number of addresses.
    #[arg(long, env = "MYELIN_GOSSIP_MAX_MEMBERS", value_name = "N",
          default_value_t = myelin_gossip::DEFAULT_MAX_MEMBERS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..=65_536))]
    pub gossip_max_members: usize,
}

/// The resolved cluster settings (present when gossip is on).
#[derive(Debug, Clone)]
pub struct GossipSettings {
    pub listen: SocketAddr,
    /// What the other nodes send to (`--gossip-advertise`, else `--gossip-listen`; a port 0
    /// is replaced by the bound port).
    pub advertise: Option<SocketAddr>,
    pub peers: Vec<SocketAddr>,
    /// `--node-id` (`None`: the advertised address, once bound).
    pub node_id: Option<String>,
    pub key: ClusterKey,
    pub probe_interval: Duration,
    pub max_members: usize,
}

impl GossipSettings {
    /// The membership's failure-detector timing.
    pub fn membership_params(&self) -> myelin_gossip::MembershipParams {
        myelin_gossip::MembershipParams {
            probe_period: self.probe_interval,
            probe_rtt: self.probe_interval * 2 / 5,
            suspect_to_down_after: self.probe_interval * 3,
            max_members: self.max_members,
        }
    }
}

fn read_key(path: &Path) -> Result<ClusterKey, String> {
    let contents = std::fs::read(path)
        .map_err(|error| format!("reading --cluster-key-file {}: {error}", path.display()))?;
    ClusterKey::from_file_contents(&contents)
        .map_err(|error| format!("--cluster-key-file {}: {error}", path.display()))
}

/// The cluster settings `args` give; `Ok(None)` when gossip is off.
pub fn resolve(args: GossipArgs) -> Result<Option<GossipSettings>, String> {
    let peers = args.peers;
    let Some(listen) = args.gossip_listen else {
        if !peers.is_empty() {
            return Err("--peer needs --gossip-listen (and --cluster-key-file)".into());
        }
        return Ok(None);
    };
    let Some(key_file) = args.cluster_key_file else {
        return Err(
            "--gossip-listen needs --cluster-key-file: every gossip packet is authenticated \
             with the cluster key (a file of at least 16 bytes, the same on every node)"
                .into(),
        );
    };
    let key = read_key(&key_file)?;
    let advertise = args.gossip_advertise;
    if advertise.is_none() && listen.ip().is_unspecified() {
        return Err(format!(
            "--gossip-listen {listen} is a wildcard address: give --gossip-advertise HOST:PORT, \
             the address the other nodes reach this one at"
        ));
    }
    let node_id = args.node_id;
    if let Some(name) = &node_id
        && (name.is_empty() || name.len() > myelin_gossip::messages::MAX_NODE_NAME_BYTES)
    {
        return Err(format!(
            "--node-id must be 1 to {} bytes",
            myelin_gossip::messages::MAX_NODE_NAME_BYTES
        ));
    }
    Ok(Some(GossipSettings {
        listen,
        advertise,
        peers,
        node_id,
        key,
        probe_interval: Duration::from_millis(args.gossip_probe_interval_ms),
        max_members: args.gossip_max_members,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct TestCli {
        #[command(flatten)]
        args: GossipArgs,
    }

    fn resolve_flags(flags: &[&str]) -> Result<Option<GossipSettings>, String> {
        let argv = std::iter::once("myelin").chain(flags.iter().copied());
        resolve(TestCli::try_parse_from(argv).unwrap().args)
    }

    #[test]
    fn gossip_needs_a_key_file_and_a_reachable_address() {
        assert!(resolve_flags(&[]).unwrap().is_none());
        let listen = ["--gossip-listen", "127.0.0.1:7946"];
        let error = resolve_flags(&listen).unwrap_err();
        assert!(error.contains("--cluster-key-file"), "{error}");
        let error = resolve_flags(&["--peer", "127.0.0.1:7000"]).unwrap_err();
        assert!(error.contains("--gossip-listen"), "{error}");
        let dir = std::env::temp_dir().join(format!("myelin-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let weak = dir.join("weak");
        std::fs::write(&weak, "short\n").unwrap();
        let strong = dir.join("strong");
        std::fs::write(&strong, "0123456789abcdef0123\n").unwrap();
        let (weak, strong) = (weak.to_str().unwrap(), strong.to_str().unwrap());
        let error = resolve_flags(&[listen[0], listen[1], "--cluster-key-file", weak]).unwrap_err();
        assert!(error.contains("at least 16"), "{error}");
        let wildcard = [
            "--gossip-listen",
            "0.0.0.0:7946",
            "--cluster-key-file",
            strong,
        ];
        let error = resolve_flags(&wildcard).unwrap_err();
        assert!(error.contains("--gossip-advertise"), "{error}");
        let error = resolve_flags(&[
            listen[0],
            listen[1],
            "--cluster-key-file",
            strong,
            "--node-id",
            "",
        ])
        .unwrap_err();
        assert!(error.contains("--node-id"), "{error}");
        let settings = resolve_flags(&[
            listen[0],
            listen[1],
            "--cluster-key-file",
            strong,
            "--peer",
            "127.0.0.1:7001",
            "--node-id",
            "a",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(settings.peers.len(), 1);
        assert_eq!(settings.node_id.as_deref(), Some("a"));
        assert_eq!(settings.probe_interval, Duration::from_millis(500));
        assert_eq!(settings.max_members, myelin_gossip::DEFAULT_MAX_MEMBERS);
        for bounded in [
            ["--gossip-probe-interval-ms", "9"],
            ["--gossip-max-members", "65537"],
        ] {
            let argv = std::iter::once("myelin").chain(bounded);
            assert!(TestCli::try_parse_from(argv).is_err(), "{bounded:?}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_config_file_turns_gossip_on() {
        let dir = std::env::temp_dir().join(format!("myelin-gossip-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        std::fs::write(&key, "0123456789abcdef0123\n").unwrap();
        let file = dir.join("myelin.toml");
        std::fs::write(
            &file,
            format!(
                "backend = [\"http://e:1\"]\n\
                 gossip-listen = \"127.0.0.1:7946\"\n\
                 peer = [\"127.0.0.1:7947\", \"127.0.0.1:7948\"]\n\
                 node-id = \"router-a\"\n\
                 cluster-key-file = \"{}\"\n\
                 gossip-probe-interval-ms = 250\n",
                key.display()
            ),
        )
        .unwrap();
        let argv = ["myelin", "--config", file.to_str().unwrap()];
        let args = crate::config::parse_command_line::<crate::config::ServeCli>(argv, None)
            .unwrap()
            .args;
        let config = crate::config::ServeConfig::resolve(args).unwrap();
        let gossip = config.gossip.expect("gossip on");
        assert_eq!(gossip.listen, "127.0.0.1:7946".parse().unwrap());
        assert_eq!(gossip.peers.len(), 2);
        assert_eq!(gossip.node_id.as_deref(), Some("router-a"));
        assert_eq!(gossip.probe_interval, Duration::from_millis(250));
        let _ = std::fs::remove_dir_all(dir);
    }
}
