//! Legs: the router configurations a run compares (`--legs`, `--external`), and the order in
//! which repeats run them.

/// The legs `myelin bench` runs by default: the residency comparison (cache-blind, load alone,
/// history alone, the estimate, the KV-event mirror, auto, the router fed the truth).
pub const DEFAULT_LEGS: &str =
    "round-robin,least-load,prefix+off,prefix+estimate,prefix+verified,prefix+auto,oracle";

/// Every leg name `--legs` accepts. A router leg may end in `:tokens` to run with the cost in
/// tokens (`myelin serve --cost tokens`), the cost the router had before the cost in seconds:
/// `prefix+off:tokens` is history-only prefix routing as it was; and in `:--FLAG=VALUE`
/// suffixes, `myelin serve` flags of that leg alone, to compare settings in one run:
/// `prefix+auto:--extra-prefill-percent=0` beside `prefix+auto`.
pub const KNOWN_LEGS: &[&str] = &[
    "round-robin",
    "least-load",
    "prefix+off",
    "prefix+estimate",
    "prefix+verified",
    "prefix+auto",
    "oracle",
];

/// The router's residency modes (`myelin serve --residency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    Off,
    Estimate,
    Verified,
    Auto,
}

impl Residency {
    fn flag(self) -> &'static str {
        match self {
            Residency::Off => "off",
            Residency::Estimate => "estimate",
            Residency::Verified => "verified",
            Residency::Auto => "auto",
        }
    }
}

/// What routes the requests of a leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegKind {
    /// `myelin serve --routing round-robin`.
    RoundRobin,
    /// `myelin serve --routing least-load`.
    LeastLoad,
    /// `myelin serve --routing prefix --residency MODE`.
    Prefix(Residency),
    /// The harness itself routes each request with the router's decision code fed the truth:
    /// the simulator's actual cache contents and queues (see [`crate::oracle`]).
    Oracle,
    /// Another router, started from a command line.
    External,
}

impl LegKind {
    /// The leg's kind as a name (for prefix legs, with the residency mode).
    pub fn describe(self) -> &'static str {
        match self {
            LegKind::RoundRobin => "round-robin",
            LegKind::LeastLoad => "least-load",
            LegKind::Prefix(Residency::Off) => "prefix+off",
            LegKind::Prefix(Residency::Estimate) => "prefix+estimate",
            LegKind::Prefix(Residency::Verified) => "prefix+verified",
            LegKind::Prefix(Residency::Auto) => "prefix+auto",
            LegKind::Oracle => "oracle",
            LegKind::External => "external",
        }
    }

    /// Whether the leg runs `myelin serve` (and so reports downgrades).
    pub fn uses_myelin_router(self) -> bool {
        !matches!(self, LegKind::Oracle | LegKind::External)
    }

    /// Whether the leg runs residency weighting, which must show at least one downgrade.
    pub fn weights_residency(self) -> bool {
        matches!(
            self,
            LegKind::Prefix(Residency::Estimate | Residency::Verified | Residency::Auto)
        )
    }

    /// Whether the router needs the engines' KV-event endpoints.
    pub fn wants_kv_events(self) -> bool {
        matches!(self, LegKind::Prefix(Residency::Verified | Residency::Auto))
    }

    /// `myelin serve` flags selecting this leg's policy.
    pub fn router_flags(self) -> Vec<&'static str> {
        match self {
            LegKind::RoundRobin => vec!["--routing", "round-robin", "--residency", "off"],
            LegKind::LeastLoad => vec!["--routing", "least-load", "--residency", "off"],
            LegKind::Prefix(residency) => {
                vec!["--routing", "prefix", "--residency", residency.flag()]
            }
            LegKind::Oracle | LegKind::External => Vec::new(),
        }
    }
}

/// One leg of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegSpec {
    pub name: String,
    pub kind: LegKind,
    /// For external legs: the command, with `{port}` and `{backends}` placeholders.
    pub command: Option<String>,
    /// `myelin serve` flags of this leg after the harness's own (`:tokens`: `--cost tokens`).
    pub router_args: Vec<String>,
}

/// Why a leg list was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LegError {
    #[error("unknown leg `{0}` (known: {known})", known = KNOWN_LEGS.join(", "))]
    Unknown(String),
    #[error("leg `{0}` is listed twice")]
    Duplicate(String),
    #[error("--external wants NAME='COMMAND {{port}} {{backends}}', got `{0}`")]
    BadExternal(String),
    #[error("--external command for `{0}` has no {{port}} placeholder")]
    NoPortPlaceholder(String),
    #[error("no legs to run")]
    Empty,
    #[error(
        "leg `{0}`: a suffix is `:tokens` or `:--FLAG=VALUE` (a `myelin serve` flag) on a router leg"
    )]
    BadSuffix(String),
}

/// Parses `--legs a,b,c`.
pub fn parse_legs(list: &str) -> Result<Vec<LegSpec>, LegError> {
    let mut legs = Vec::new();
    for name in list
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
    {
        let mut parts = name.split(':');
        let base = parts.next().unwrap_or_default();
        let mut router_args: Vec<String> = Vec::new();
        let mut suffixes = String::new();
        for suffix in parts {
            match suffix {
                "tokens" => router_args.extend(["--cost".into(), "tokens".into()]),
                flag if flag.starts_with("--") && flag.len() > 2 => {
                    router_args.push(flag.to_string())
                }
                _ => return Err(LegError::BadSuffix(name.to_string())),
            }
            suffixes.push(':');
            suffixes.push_str(suffix);
        }
        let kind = match base {
            "round-robin" => LegKind::RoundRobin,
            "least-load" => LegKind::LeastLoad,
            "prefix+off" | "prefix" => LegKind::Prefix(Residency::Off),
            "prefix+estimate" => LegKind::Prefix(Residency::Estimate),
            "prefix+verified" => LegKind::Prefix(Residency::Verified),
            "prefix+auto" => LegKind::Prefix(Residency::Auto),
            "oracle" => LegKind::Oracle,
            unknown => return Err(LegError::Unknown(unknown.to_string())),
        };
        if !router_args.is_empty() && !kind.uses_myelin_router() {
            return Err(LegError::BadSuffix(name.to_string()));
        }
        push_unique(
            &mut legs,
            LegSpec {
                name: format!("{}{suffixes}", kind.describe()),
                kind,
                command: None,
                router_args,
            },
        )?;
    }
    Ok(legs)
}

/// Parses one `--external NAME='COMMAND'`.
pub fn parse_external(spec: &str) -> Result<LegSpec, LegError> {
    let (name, command) = spec
        .split_once('=')
        .map(|(name, command)| (name.trim(), command.trim()))
        .filter(|(name, command)| !name.is_empty() && !command.is_empty())
        .ok_or_else(|| LegError::BadExternal(spec.to_string()))?;
    if !command.contains("{port}") {
        return Err(LegError::NoPortPlaceholder(name.to_string()));
    }
    Ok(LegSpec {
        name: name.to_string(),
        kind: LegKind::External,
        command: Some(command.to_string()),
        router_args: Vec::new(),
    })
}

/// All legs of a run: `--legs` then each `--external`.
pub fn all_legs(list: &str, externals: &[String]) -> Result<Vec<LegSpec>, LegError> {
    let mut legs = parse_legs(list)?;
    for external in externals {
        push_unique(&mut legs, parse_external(external)?)?;
    }
    if legs.is_empty() {
        return Err(LegError::Empty);
    }
    Ok(legs)
}

fn push_unique(legs: &mut Vec<LegSpec>, leg: LegSpec) -> Result<(), LegError> {
    if legs.iter().any(|existing| existing.name == leg.name) {
        return Err(LegError::Duplicate(leg.name));
    }
    legs.push(leg);
    Ok(())
}

/// The order legs run in for repeat `repeat`: forward on even repeats, backward on odd ones,
/// so drift over time (a warming machine, a neighbour's build) does not favour one leg.
pub fn leg_order(legs: usize, repeat: u32) -> Vec<usize> {
    if repeat.is_multiple_of(2) {
        (0..legs).collect()
    } else {
        (0..legs).rev().collect()
    }
}

/// Substitutes `{port}` and `{backends}` (space-separated engine URLs) into an external
/// command.
pub fn external_command(template: &str, port: u16, backends: &[String]) -> String {
    template
        .replace("{port}", &port.to_string())
        .replace("{backends}", &backends.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_legs_parse_in_order() {
        let legs = parse_legs(DEFAULT_LEGS).unwrap();
        let names: Vec<&str> = legs.iter().map(|leg| leg.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "round-robin",
                "least-load",
                "prefix+off",
                "prefix+estimate",
                "prefix+verified",
                "prefix+auto",
                "oracle"
            ]
        );
        let weighting: Vec<bool> = legs
            .iter()
            .map(|leg| leg.kind.weights_residency())
            .collect();
        assert_eq!(weighting, [false, false, false, true, true, true, false]);
    }

    #[test]
    fn every_known_leg_parses_to_itself() {
        for name in KNOWN_LEGS {
            let legs = parse_legs(name).unwrap();
            assert_eq!(legs[0].name, *name);
        }
        assert!(
            parse_legs("prefix+auto").unwrap()[0]
                .kind
                .weights_residency()
        );
        assert!(
            !parse_legs("prefix+off").unwrap()[0]
                .kind
                .weights_residency()
        );
        assert_eq!(
            parse_legs("prefix+verified").unwrap()[0]
                .kind
                .router_flags(),
            ["--routing", "prefix", "--residency", "verified"]
        );
    }

    #[test]
    fn bad_leg_lists_are_rejected() {
        assert_eq!(
            parse_legs("round-robin,magic"),
            Err(LegError::Unknown("magic".into()))
        );
        assert_eq!(
            parse_legs("oracle,oracle"),
            Err(LegError::Duplicate("oracle".into()))
        );
        assert_eq!(all_legs("", &[]), Err(LegError::Empty));
        assert!(matches!(
            parse_external("smg"),
            Err(LegError::BadExternal(_))
        ));
        assert!(matches!(
            parse_external("smg=smg launch"),
            Err(LegError::NoPortPlaceholder(_))
        ));
    }

    #[test]
    fn a_tokens_suffix_runs_the_leg_with_the_cost_in_tokens() {
        let legs = parse_legs("prefix+off,prefix+off:tokens,least-load").unwrap();
        assert_eq!(legs[1].name, "prefix+off:tokens");
        assert_eq!(legs[1].kind, LegKind::Prefix(Residency::Off));
        assert_eq!(legs[1].router_args, ["--cost", "tokens"]);
        assert!(legs[0].router_args.is_empty());
        assert_eq!(
            parse_legs("oracle:tokens"),
            Err(LegError::BadSuffix("oracle:tokens".into()))
        );
    }

    #[test]
    fn flag_suffixes_give_one_leg_its_own_serve_flags() {
        let legs = parse_legs(
            "prefix+auto,prefix+auto:--extra-prefill-percent=0,prefix:tokens:--load-bound-tokens=0",
        )
        .unwrap();
        assert_eq!(legs[1].name, "prefix+auto:--extra-prefill-percent=0");
        assert_eq!(legs[1].kind, LegKind::Prefix(Residency::Auto));
        assert_eq!(legs[1].router_args, ["--extra-prefill-percent=0"]);
        assert!(legs[0].router_args.is_empty());
        assert_eq!(legs[2].name, "prefix+off:tokens:--load-bound-tokens=0");
        assert_eq!(
            legs[2].router_args,
            ["--cost", "tokens", "--load-bound-tokens=0"]
        );
        for bad in ["prefix+auto:fast", "prefix+auto:--", "oracle:--cost=tokens"] {
            assert_eq!(parse_legs(bad), Err(LegError::BadSuffix(bad.into())));
        }
        assert_eq!(
            parse_legs("prefix+auto:--x=1,prefix+auto:--x=1"),
            Err(LegError::Duplicate("prefix+auto:--x=1".into()))
        );
    }

    #[test]
    fn external_legs_substitute_port_and_backends() {
        let legs = all_legs(
            "oracle",
            &["smg=smg launch --port {port} --worker-urls {backends}".into()],
        )
        .unwrap();
        assert_eq!(legs[1].kind, LegKind::External);
        let command = external_command(
            legs[1].command.as_deref().unwrap(),
            8123,
            &["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
        );
        assert_eq!(
            command,
            "smg launch --port 8123 --worker-urls http://127.0.0.1:1 http://127.0.0.1:2"
        );
    }

    #[test]
    fn repeats_alternate_the_order() {
        assert_eq!(leg_order(3, 0), [0, 1, 2]);
        assert_eq!(leg_order(3, 1), [2, 1, 0]);
        assert_eq!(leg_order(3, 2), [0, 1, 2]);
    }
}
