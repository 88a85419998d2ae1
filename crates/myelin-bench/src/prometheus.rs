//! Reading counters out of Prometheus text exposition (router and engine /metrics).

use std::collections::BTreeMap;

/// Sums every sample of `name` (all label sets). `None` when the metric is absent.
pub fn sum_samples(text: &str, name: &str) -> Option<f64> {
    let mut total = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // The name must end here: labels, or whitespace before the value.
        let value_part = if let Some(labels) = rest.strip_prefix('{') {
            match labels.rfind('}') {
                Some(close) => &labels[close + 1..],
                None => continue,
            }
        } else if rest.starts_with([' ', '\t']) {
            rest
        } else {
            continue;
        };
        let Some(value) = value_part
            .split_whitespace()
            .next()
            .and_then(|value| value.parse::<f64>().ok())
        else {
            continue;
        };
        *total.get_or_insert(0.0) += value;
    }
    total
}

/// [`sum_samples`] as a whole count (negative and NaN read as 0).
pub fn sum_count(text: &str, name: &str) -> Option<u64> {
    sum_samples(text, name).map(|value| {
        if value.is_finite() && value > 0.0 {
            value.round() as u64
        } else {
            0
        }
    })
}

/// Sums the samples of `name` by the value of its label `label` (samples without that label
/// are left out). Empty when the metric is absent.
pub fn samples_by_label(text: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut by_value = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some(labels) = line
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix('{'))
        else {
            continue;
        };
        let Some((pairs, value_part)) = split_labels(labels) else {
            continue;
        };
        let Some(value) = value_part
            .split_whitespace()
            .next()
            .and_then(|value| value.parse::<f64>().ok())
        else {
            continue;
        };
        if let Some((_, label_value)) = pairs.into_iter().find(|(key, _)| key == label) {
            *by_value.entry(label_value).or_insert(0.0) += value;
        }
    }
    by_value
}

/// Parses `key="value",...}` (the text after `{`) into pairs and the rest of the line after
/// the closing `}`. Handles `\"`, `\\` and `\n` escapes in values.
fn split_labels(text: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut pairs = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((pairs, after));
        }
        let (key, after_key) = rest.split_once('=')?;
        let mut chars = after_key.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            let (index, character) = chars.next()?;
            match character {
                '"' => break index,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                other => value.push(other),
            }
        };
        pairs.push((key.trim().to_string(), value));
        rest = &after_key[1 + end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP myelin_router_residency_route_downgrades_total Downgrades.\n\
# TYPE myelin_router_residency_route_downgrades_total counter\n\
myelin_router_residency_route_downgrades_total{shard=\"0\"} 3\n\
myelin_router_residency_route_downgrades_total{shard=\"1\",path=\"a}b\"} 4\n\
myelin_router_residency_route_downgrades_total_extra 100\n\
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 1.5e3\n\
vllm:prefix_cache_hits_total 500\n";

    #[test]
    fn sums_every_label_set_of_exactly_that_metric() {
        assert_eq!(
            sum_count(TEXT, "myelin_router_residency_route_downgrades_total"),
            Some(7)
        );
        assert_eq!(
            sum_samples(TEXT, "vllm:prefix_cache_hits_total"),
            Some(2000.0)
        );
        assert_eq!(sum_samples(TEXT, "vllm:absent"), None);
    }

    #[test]
    fn sums_by_one_label_value() {
        let text = "# TYPE myelin_router_lookups_total counter\n\
myelin_router_lookups_total{shard=\"0\"} 10\n\
myelin_router_lookups_total{kind=\"a\\\"}\",shard=\"1\"} 4\n\
myelin_router_lookups_total{shard=\"1\",kind=\"b\"} 5\n\
myelin_router_lookups_total{kind=\"c\"} 99\n\
myelin_router_lookups_total_other{shard=\"0\"} 1000\n";
        let by_shard = samples_by_label(text, "myelin_router_lookups_total", "shard");
        assert_eq!(
            by_shard.into_iter().collect::<Vec<_>>(),
            [("0".to_string(), 10.0), ("1".to_string(), 9.0)]
        );
        assert!(samples_by_label(TEXT, "myelin_router_lookups_total", "shard").is_empty());
        let downgrades = samples_by_label(
            TEXT,
            "myelin_router_residency_route_downgrades_total",
            "path",
        );
        assert_eq!(downgrades.get("a}b"), Some(&4.0));
    }
}
