//! Cutting a sequence of layers into K contiguous stages.
//!
//! A *balance* is the number of layers per stage, as in torchgpipe's `balance=[...]`. The pipeline
//! runs at the pace of its slowest stage, so [`balance_by_cost`] minimises the cost of the most
//! expensive stage exactly, rather than GPipe's variance heuristic.

use std::ops::Range;

/// Why a balance or a cost list was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    /// A balance with no stages, or a request for zero stages.
    #[error("a partition needs at least one stage")]
    NoStages,
    /// More stages than layers: some stage would be empty.
    #[error(
        "cannot split {layers} layers into {stages} non-empty stages (more stages than layers)"
    )]
    TooManyStages { stages: usize, layers: usize },
    /// Stage `stage` of the balance has zero layers.
    #[error("stage {stage} of the balance has 0 layers")]
    EmptyStage { stage: usize },
    /// The balance does not add up to the model's layer count.
    #[error("balance covers {balance_sum} layers but the model has {num_layers}")]
    LayerCountMismatch {
        balance_sum: usize,
        num_layers: usize,
    },
    /// An explicit balance lists a different number of stages than the pipeline has.
    #[error("balance has {given} stages but the pipeline has {stages}")]
    StageCountMismatch { given: usize, stages: usize },
    /// A layer cost is negative, NaN or infinite.
    #[error("layer {layer} has cost {cost}; costs must be finite and non-negative")]
    InvalidCost { layer: usize, cost: f64 },
}

/// Checks that `balance` splits `num_layers` layers into non-empty stages.
///
/// "More stages than layers" is reported before "empty stage" because it is the root cause.
pub fn validate_balance(balance: &[usize], num_layers: usize) -> Result<(), PartitionError> {
    if balance.is_empty() {
        return Err(PartitionError::NoStages);
    }
    if balance.len() > num_layers {
        return Err(PartitionError::TooManyStages {
            stages: balance.len(),
            layers: num_layers,
        });
    }
    if let Some(stage) = balance.iter().position(|&n| n == 0) {
        return Err(PartitionError::EmptyStage { stage });
    }
    let balance_sum: usize = balance.iter().sum();
    if balance_sum != num_layers {
        return Err(PartitionError::LayerCountMismatch {
            balance_sum,
            num_layers,
        });
    }
    Ok(())
}

/// Checks an explicit `balance` for a pipeline of `stages` (virtual) stages over `num_layers`
/// layers: the one place this rule lives (the builder and the examples' flags both call it).
pub fn validate_balance_for(
    balance: &[usize],
    stages: usize,
    num_layers: usize,
) -> Result<(), PartitionError> {
    if balance.len() != stages {
        return Err(PartitionError::StageCountMismatch {
            given: balance.len(),
            stages,
        });
    }
    validate_balance(balance, num_layers)
}

/// The layer index range of each stage, in order (stage j owns `ranges[j]`).
pub fn stage_ranges(balance: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    balance
        .iter()
        .map(|&n| {
            let range = start..start + n;
            start += n;
            range
        })
        .collect()
}

/// The summed cost of each stage, summed left to right (the same order [`balance_by_cost`] uses,
/// so its optimum can be compared bit for bit).
pub fn stage_costs(costs: &[f64], balance: &[usize]) -> Vec<f64> {
    stage_ranges(balance)
        .into_iter()
        .map(|r| costs[r].iter().fold(0.0, |acc, c| acc + c))
        .collect()
}

/// Splits layers with the given costs into `k` contiguous, non-empty stages so that the most
/// expensive stage is as cheap as possible (exact, by dynamic programming in O(k·n²)).
///
/// Among the optimal splits it picks the one with the most evenly sized stages (smallest sum of
/// squared stage sizes), so that e.g. zero-cost layers are spread out rather than piled up;
/// remaining ties put the larger stages first.
pub fn balance_by_cost(costs: &[f64], k: usize) -> Result<Vec<usize>, PartitionError> {
    if k == 0 {
        return Err(PartitionError::NoStages);
    }
    if let Some((layer, &cost)) = costs
        .iter()
        .enumerate()
        .find(|(_, c)| !c.is_finite() || **c < 0.0)
    {
        return Err(PartitionError::InvalidCost { layer, cost });
    }
    if k > costs.len() {
        return Err(PartitionError::TooManyStages {
            stages: k,
            layers: costs.len(),
        });
    }
    let bottleneck = min_bottleneck(costs, k);
    Ok(most_even_split(costs, k, bottleneck))
}

/// Calls `visit(start, end, cost)` for every segment `start..end` with `start` in `starts`,
/// where `cost` is the segment's sum taken left to right.
fn for_each_segment(costs: &[f64], starts: Range<usize>, mut visit: impl FnMut(usize, usize, f64)) {
    for start in starts {
        let mut sum = 0.0;
        for end in start + 1..=costs.len() {
            sum += costs[end - 1];
            visit(start, end, sum);
        }
    }
}

/// The smallest achievable cost of the most expensive stage.
fn min_bottleneck(costs: &[f64], k: usize) -> f64 {
    let n = costs.len();
    // best[i] = least bottleneck for the first i layers in `parts` stages.
    let mut best = vec![f64::INFINITY; n + 1];
    best[0] = 0.0;
    for _parts in 1..=k {
        let mut next = vec![f64::INFINITY; n + 1];
        for_each_segment(costs, 0..n, |start, end, sum| {
            let candidate = best[start].max(sum);
            if candidate < next[end] {
                next[end] = candidate;
            }
        });
        best = next;
    }
    best[n]
}

/// Among splits whose every stage costs at most `bottleneck`, the one with the smallest sum of
/// squared stage sizes. Two passes (bottleneck first, evenness second) because a lexicographic
/// (bottleneck, evenness) DP would not have optimal substructure.
fn most_even_split(costs: &[f64], k: usize, bottleneck: f64) -> Vec<usize> {
    let n = costs.len();
    // square[p][i] = least Σ size² for the first i layers in p stages, within the bottleneck.
    let mut square = vec![vec![u128::MAX; n + 1]; k + 1];
    let mut cut = vec![vec![0usize; n + 1]; k + 1];
    square[0][0] = 0;
    for parts in 1..=k {
        let (done, rest) = square.split_at_mut(parts);
        let prev = &done[parts - 1];
        let row = &mut rest[0];
        for_each_segment(costs, 0..n, |start, end, sum| {
            if prev[start] == u128::MAX || sum > bottleneck {
                return;
            }
            let size = (end - start) as u128;
            let candidate = prev[start] + size * size;
            // `<=`: of equally even splits, the later last cut (larger early stages) wins.
            if candidate <= row[end] {
                row[end] = candidate;
                cut[parts][end] = start;
            }
        });
    }
    let mut balance = vec![0; k];
    let mut end = n;
    for parts in (1..=k).rev() {
        let start = cut[parts][end];
        balance[parts - 1] = end - start;
        end = start;
    }
    balance
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_accepts_good_balance() {
        assert_eq!(validate_balance(&[2, 3, 1], 6), Ok(()));
    }

    #[test]
    fn validate_names_each_problem() {
        let e = validate_balance(&[2, 0, 4], 6).unwrap_err();
        assert_eq!(e, PartitionError::EmptyStage { stage: 1 });
        assert_eq!(e.to_string(), "stage 1 of the balance has 0 layers");

        let e = validate_balance(&[2, 3], 6).unwrap_err();
        assert_eq!(
            e,
            PartitionError::LayerCountMismatch {
                balance_sum: 5,
                num_layers: 6
            }
        );
        assert_eq!(e.to_string(), "balance covers 5 layers but the model has 6");

        let e = validate_balance(&[1, 1, 1, 1], 3).unwrap_err();
        assert_eq!(
            e,
            PartitionError::TooManyStages {
                stages: 4,
                layers: 3
            }
        );
        assert!(e.to_string().contains("3 layers into 4"));

        assert_eq!(validate_balance(&[], 3), Err(PartitionError::NoStages));
    }

    #[test]
    fn ranges_are_contiguous() {
        assert_eq!(stage_ranges(&[2, 3, 1]), vec![0..2, 2..5, 5..6]);
        assert!(stage_ranges(&[]).is_empty());
    }

    #[test]
    fn hand_computed_balances() {
        // One heavy layer must sit alone; the rest share.
        assert_eq!(
            balance_by_cost(&[1.0, 1.0, 8.0, 1.0, 1.0], 3).unwrap(),
            vec![2, 1, 2]
        );
        // 1+2+3 = 6 | 4 | 5: bottleneck 6 is optimal ({1,2,3,4,5} into 3: ≥ 15/3 = 5, and 5
        // alone forces 1..4 into 2 parts, best 6 = 1+2+3 | 4).
        let b = balance_by_cost(&[1.0, 2.0, 3.0, 4.0, 5.0], 3).unwrap();
        assert_eq!(b, vec![3, 1, 1]);
        assert_eq!(
            stage_costs(&[1.0, 2.0, 3.0, 4.0, 5.0], &b),
            vec![6.0, 4.0, 5.0]
        );
        // Equal costs split evenly.
        assert_eq!(balance_by_cost(&[1.0; 8], 4).unwrap(), vec![2, 2, 2, 2]);
        assert_eq!(balance_by_cost(&[1.0; 7], 3).unwrap(), vec![3, 2, 2]);
        // One stage takes everything; as many stages as layers gives ones.
        assert_eq!(balance_by_cost(&[3.0, 1.0], 1).unwrap(), vec![2]);
        assert_eq!(balance_by_cost(&[3.0, 1.0, 2.0], 3).unwrap(), vec![1, 1, 1]);
    }

    #[test]
    fn ties_prefer_even_sizes() {
        // All-zero costs: every split is optimal, the even one is chosen.
        assert_eq!(balance_by_cost(&[0.0; 6], 3).unwrap(), vec![2, 2, 2]);
        // Bottleneck is the 10; the cheap layers spread out instead of piling up.
        let costs = [10.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5];
        assert_eq!(balance_by_cost(&costs, 3).unwrap(), vec![1, 3, 3]);
    }

    #[test]
    fn balance_by_cost_rejects_bad_input() {
        assert_eq!(balance_by_cost(&[1.0], 0), Err(PartitionError::NoStages));
        assert_eq!(
            balance_by_cost(&[1.0, 2.0], 3),
            Err(PartitionError::TooManyStages {
                stages: 3,
                layers: 2
            })
        );
        let e = balance_by_cost(&[1.0, -2.0], 1).unwrap_err();
        assert!(e.to_string().contains("layer 1 has cost -2"), "{e}");
        assert!(balance_by_cost(&[f64::NAN], 1).is_err());
        assert!(balance_by_cost(&[f64::INFINITY], 1).is_err());
    }

    /// Every composition of `n` into `k` positive parts.
    fn all_balances(n: usize, k: usize) -> Vec<Vec<usize>> {
        if k == 1 {
            return vec![vec![n]];
        }
        (1..=n - (k - 1))
            .flat_map(|first| {
                all_balances(n - first, k - 1)
                    .into_iter()
                    .map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
            })
            .collect()
    }

    /// Small deterministic PRNG (xorshift64*) so the test needs no crates.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn max_cost(costs: &[f64], balance: &[usize]) -> f64 {
        stage_costs(costs, balance).into_iter().fold(0.0, f64::max)
    }

    fn sum_squares(balance: &[usize]) -> usize {
        balance.iter().map(|n| n * n).sum()
    }

    #[test]
    fn matches_brute_force_on_random_inputs() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for case in 0..400 {
            let n = 1 + rng.below(9) as usize;
            let k = 1 + rng.below(n as u64) as usize;
            // Half the cases use small integers (many ties), half arbitrary fractions.
            let costs: Vec<f64> = (0..n)
                .map(|_| {
                    if case % 2 == 0 {
                        rng.below(5) as f64
                    } else {
                        rng.below(1_000_000) as f64 / 997.0
                    }
                })
                .collect();
            let got = balance_by_cost(&costs, k).unwrap();
            validate_balance(&got, n).unwrap();
            let candidates = all_balances(n, k);
            let best = candidates
                .iter()
                .map(|b| max_cost(&costs, b))
                .fold(f64::INFINITY, f64::min);
            assert_eq!(max_cost(&costs, &got), best, "costs {costs:?} k {k}");
            let most_even = candidates
                .iter()
                .filter(|b| max_cost(&costs, b) == best)
                .map(|b| sum_squares(b))
                .min()
                .unwrap();
            assert_eq!(sum_squares(&got), most_even, "costs {costs:?} k {k}");
        }
    }
}
