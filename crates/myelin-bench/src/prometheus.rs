//! Reading counters out of Prometheus text exposition (router and engine /metrics).

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
}
