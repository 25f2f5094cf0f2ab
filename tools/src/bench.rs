//! Shared plumbing for the benchmark binaries (tools/src/bin/bench_*.rs): repeated
//! timing with a warm-up, medians, and one JSON shape that scripts/bench.sh
//! merges and scripts/bench_compare.py compares.
//!
//! JSON written by [`Report::write_json`]:
//! ```json
//! {"schema":"epmem-bench/1","bench":"staging","device":"NVIDIA H200","kind":"cuda",
//!  "runs":7,"warmup":2,
//!  "scenarios":[{"name":"c_ours/32MiB","group":"pagein","value":41.2,"unit":"GB/s",
//!                "higher_is_better":true,"x":32,"samples":[...]}]}
//! ```
//! `name` is unique within a bench; `group` and `x` let the report plot a
//! series (e.g. GB/s against size).

use std::time::Instant;

use serde_json::json;

/// Median of samples (the mean of the middle two for an even count); NaN if empty.
pub fn median(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// Run `f` `warmup` times unmeasured, then `runs` times, returning what each
/// measured call returned (the caller decides what a sample is: ms, GB/s ...).
pub fn repeat<F: FnMut() -> f64>(warmup: usize, runs: usize, mut f: F) -> Vec<f64> {
    for _ in 0..warmup {
        f();
    }
    (0..runs).map(|_| f()).collect()
}

/// Wall-clock milliseconds of `f`.
pub fn time_ms<F: FnOnce()>(f: F) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

/// GB/s (10^9 bytes per second) for `bytes` moved in `ms`.
pub fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

/// One measured figure.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub group: String,
    pub unit: String,
    pub higher_is_better: bool,
    pub x: Option<f64>,
    pub samples: Vec<f64>,
}

impl Scenario {
    pub fn new(group: &str, name: &str, unit: &str, higher_is_better: bool, samples: Vec<f64>) -> Self {
        Self {
            name: name.to_string(),
            group: group.to_string(),
            unit: unit.to_string(),
            higher_is_better,
            x: None,
            samples,
        }
    }
    pub fn at(mut self, x: f64) -> Self {
        self.x = Some(x);
        self
    }
    pub fn value(&self) -> f64 {
        median(&self.samples)
    }
}

/// A benchmark's results: scenarios plus free-form markdown tables.
#[derive(Debug, Clone)]
pub struct Report {
    pub bench: String,
    pub device: String,
    pub kind: String,
    pub runs: usize,
    pub warmup: usize,
    pub scenarios: Vec<Scenario>,
    pub markdown: String,
}

impl Report {
    pub fn new(bench: &str, device: &str, kind: &str, runs: usize, warmup: usize) -> Self {
        Self {
            bench: bench.to_string(),
            device: device.to_string(),
            kind: kind.to_string(),
            runs,
            warmup,
            scenarios: Vec::new(),
            markdown: String::new(),
        }
    }

    pub fn push(&mut self, s: Scenario) -> f64 {
        let v = s.value();
        self.scenarios.push(s);
        v
    }

    /// The median of a scenario by name.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.scenarios.iter().find(|s| s.name == name).map(Scenario::value)
    }

    /// The report as JSON. A non-finite figure (a failed run's NaN) is
    /// `null`, which is what serde_json writes for it.
    pub fn to_json(&self) -> String {
        let scenarios: Vec<serde_json::Value> = self
            .scenarios
            .iter()
            .map(|s| {
                json!({"name": s.name, "group": s.group, "value": s.value(), "unit": s.unit,
                       "higher_is_better": s.higher_is_better, "x": s.x, "samples": s.samples})
            })
            .collect();
        let mut o = json!({"schema": "epmem-bench/1", "bench": self.bench, "device": self.device,
                           "kind": self.kind, "runs": self.runs, "warmup": self.warmup,
                           "scenarios": scenarios, "markdown": self.markdown})
        .to_string();
        o.push('\n');
        o
    }

    /// Write JSON to `path`.
    pub fn write_json(&self, path: &str) -> std::io::Result<()> {
        std::fs::write(path, self.to_json())
    }
}

/// `--json PATH` and `--quick` from the command line (the flags every bench takes).
#[derive(Debug, Clone, Default)]
pub struct BenchArgs {
    pub json: Option<String>,
    pub quick: bool,
    pub runs: Option<usize>,
}

impl BenchArgs {
    /// Unknown arguments and bad values are reported and ignored, so a
    /// bench.sh that passes a newer flag still gets a run.
    pub fn parse() -> Self {
        use lexopt::prelude::*;
        let mut a = BenchArgs::default();
        let mut p = lexopt::Parser::from_env();
        loop {
            let arg = match p.next() {
                Ok(Some(arg)) => arg,
                Ok(None) => break,
                Err(e) => {
                    eprintln!("ignoring: {e}");
                    continue;
                }
            };
            let r = match arg {
                Long("json") => p.value().and_then(|v| v.string()).map(|v| a.json = Some(v)),
                Long("quick") => Ok(a.quick = true),
                Long("runs") => p.value().and_then(|v| v.parse()).map(|v| a.runs = Some(v)),
                other => Err(other.unexpected()),
            };
            if let Err(e) = r {
                eprintln!("ignoring: {e}");
            }
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn json_escapes_and_carries_medians() {
        let mut r = Report::new("t\"x", "dev", "host", 3, 1);
        r.push(Scenario::new("g", "a/1", "GB/s", true, vec![1.0, 5.0, 3.0]).at(1.0));
        r.markdown = "| a |\n".into();
        let j = r.to_json();
        assert!(j.contains("\"bench\":\"t\\\"x\""), "{j}");
        assert!(j.contains("\"markdown\":\"| a |\\n\""), "{j}");
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["scenarios"][0]["value"], 3.0, "{j}");
        assert_eq!(r.get("a/1"), Some(3.0));
    }
}
