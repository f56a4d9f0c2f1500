//! The balance of one pipeline by dynamic programming over layer ranges (the recurrence of
//! PipeDream's planner, for a chain of stages on given devices): stage s on its device runs
//! `work × weight[s]` seconds per micro-batch, and the link from stage s to stage s + 1 is busy
//! `link(s, j)` seconds per micro-batch when stage s ends before layer j. Compute and transfers
//! overlap (a send does not hold its device), so a pipeline goes at the pace of its slowest
//! stage or link; the balance minimises that pace.
//!
//! `best[s][j]`, the least pace of layers `0..j` in stages `0..=s`, is
//! `min over i of max(best[s-1][i], work(i..j) × weight[s], link(s, j))`. Scanning the start i
//! down from j - 1, stage s's compute only grows, so the scan stops once it alone passes the
//! best found for the cell: about n² / 2 · ln S steps for n layers in S stages rather than
//! n² · S, and no balance is enumerated.

/// Layers per stage minimising the slowest stage's or link's seconds per micro-batch:
/// `work[i]` is layer i's compute (any unit), stage s weighs `weights[s]` (seconds per unit
/// on its device), `link(s, j)` is the seconds the link after stage s is busy when the stage
/// ends before layer j (0 for the last stage or stages on one device). Every stage gets at
/// least one layer; None when there are more stages than layers.
pub fn min_max_partition(
    work: &[f64],
    weights: &[f64],
    link: impl Fn(usize, usize) -> f64,
) -> Option<Vec<usize>> {
    let (n, stages) = (work.len(), weights.len());
    if stages == 0 || stages > n {
        return None;
    }
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(0.0);
    for &w in work {
        prefix.push(prefix.last().copied().unwrap_or(0.0) + w);
    }
    // best[s][j] and the start of stage s in it; infinite where unreachable.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut start = vec![vec![0usize; n + 1]; stages];
    for j in 1..=n - (stages - 1) {
        best[0][j] = (prefix[j] * weights[0]).max(link(0, j));
    }
    for s in 1..stages {
        // Stage s ends before j: at least s layers before it, one in it, and one for each
        // stage after it.
        for j in s + 1..=n - (stages - 1 - s) {
            let out = link(s, j);
            let (mut value, mut from) = (f64::INFINITY, j - 1);
            for i in (s..j).rev() {
                let compute = (prefix[j] - prefix[i]) * weights[s];
                if compute.max(out) >= value {
                    break;
                }
                let v = best[s - 1][i].max(compute).max(out);
                if v < value {
                    value = v;
                    from = i;
                }
            }
            best[s][j] = value;
            start[s][j] = from;
        }
    }
    let mut balance = vec![0; stages];
    let mut end = n;
    for s in (0..stages).rev() {
        let from = if s == 0 { 0 } else { start[s][end] };
        balance[s] = end - from;
        end = from;
    }
    Some(balance)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::search::compositions;

    /// The pace of a balance, as the recurrence defines it.
    fn pace(work: &[f64], weights: &[f64], link: &dyn Fn(usize, usize) -> f64, b: &[usize]) -> f64 {
        let mut at = 0;
        let mut worst = 0.0f64;
        for (s, &len) in b.iter().enumerate() {
            let sum: f64 = work[at..at + len].iter().sum();
            at += len;
            worst = worst.max(sum * weights[s]).max(link(s, at));
        }
        worst
    }

    /// Against every balance: uneven layers, uneven devices, and a slow link that costs more
    /// after some layers (large outputs) than after others, on the boundary it crosses.
    #[test]
    fn equals_enumeration_with_links() {
        let work = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0];
        let out = [2.0, 9.0, 1.0, 1.0, 7.0, 2.0, 8.0, 1.0, 3.0, 0.0];
        for weights in [vec![1.0; 4], vec![1.0, 0.5, 2.0, 1.0], vec![0.25, 1.0, 1.0]] {
            for slow in [0.0, 1.0, 3.0] {
                // The link after stage 1 leaves the node: `slow` seconds per output unit; the
                // others take 0.1. The last stage sends nothing.
                let stages = weights.len();
                let link_last = move |s: usize, j: usize| match s {
                    _ if s + 1 == stages => 0.0,
                    1 => out[j - 1] * slow,
                    _ => out[j - 1] * 0.1,
                };
                let got = min_max_partition(&work, &weights, link_last).unwrap();
                let best = compositions(work.len(), stages)
                    .iter()
                    .map(|b| pace(&work, &weights, &link_last, b))
                    .fold(f64::INFINITY, f64::min);
                let p = pace(&work, &weights, &link_last, &got);
                assert_eq!(got.iter().sum::<usize>(), work.len());
                assert!(got.iter().all(|&l| l >= 1), "{got:?}");
                assert!(
                    (p - best).abs() <= 1e-12,
                    "{weights:?} slow {slow}: {got:?} {p} vs {best}"
                );
            }
        }
    }

    #[test]
    fn more_stages_than_layers_is_none() {
        assert_eq!(min_max_partition(&[1.0, 1.0], &[1.0; 3], |_, _| 0.0), None);
        assert_eq!(
            min_max_partition(&[1.0, 2.0], &[1.0; 2], |_, _| 0.0),
            Some(vec![1, 1])
        );
    }
}
