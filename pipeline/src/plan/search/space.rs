//! The dimensions the search enumerates besides balances: (kind, chunks) pairs, micro-batch
//! counts, and the device orders of one replica or of R replicas.

use crate::schedule::ScheduleKind;

use crate::plan::cost::CostModel;
use crate::plan::PlanOptions;

/// The (kind, chunks) pairs to try on k devices.
pub fn kinds_and_chunks(options: &PlanOptions, k: usize) -> Vec<(ScheduleKind, usize)> {
    let mut out = Vec::new();
    for &kind in &options.kinds {
        let choices = kind.def().chunks.planner_choices(k, &options.chunks);
        out.extend(choices.into_iter().map(|v| (kind, v)));
    }
    out
}

/// The micro-batch counts to try: the options' list, or 1, 2, 3, 4, 6, 8, 12, ... and K, 2K, 4K,
/// each leaving every micro-batch of `batch` at least the options' smallest micro-batch.
pub fn micro_batch_counts(options: &PlanOptions, k: usize, batch: usize) -> Vec<usize> {
    let batch = (batch / options.min_micro_batch.max(1)).max(1);
    let mut ms: Vec<usize> = match &options.micro_batches {
        Some(list) => list.clone(),
        None => {
            let mut v = vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64];
            v.extend([k, 2 * k, 4 * k]);
            v
        }
    };
    ms.retain(|&m| m >= 1 && m <= batch);
    ms.sort_unstable();
    ms.dedup();
    ms
}

/// Device orders to try for k devices: every distinct arrangement of the chosen devices' kinds
/// when there are few, else the given order, fastest first, slowest first and most memory first.
/// The chosen devices: the first k, the k fastest and the k with most memory.
pub fn device_orders(model: &CostModel<'_>, k: usize) -> Vec<Vec<usize>> {
    let specs = model.specs;
    let all: Vec<usize> = (0..specs.len()).collect();
    let by = |key: &dyn Fn(usize) -> f64| {
        let mut v = all.clone();
        v.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        v
    };
    let fast = by(&|d| specs[d].flops_per_sec);
    let roomy = by(&|d| specs[d].memory_bytes as f64);
    let mut subsets: Vec<Vec<usize>> = Vec::new();
    for s in [all[..k].to_vec(), fast[..k].to_vec(), roomy[..k].to_vec()] {
        let mut sorted = s.clone();
        sorted.sort_unstable();
        if !subsets.iter().any(|x| {
            let mut y = x.clone();
            y.sort_unstable();
            y == sorted
        }) {
            subsets.push(s);
        }
    }
    let mut orders: Vec<Vec<usize>> = Vec::new();
    // Orders of the same device kinds whose devices share nodes alike cost the same.
    let key = |o: &[usize]| -> (Vec<(u64, u64)>, Vec<usize>) {
        let kinds = o
            .iter()
            .map(|&d| (specs[d].flops_per_sec.to_bits(), specs[d].memory_bytes))
            .collect();
        (kinds, model.links.node_pattern(o))
    };
    for subset in subsets {
        for o in arrangements(model, &subset) {
            let key_o = key(&o);
            let dup = orders.iter().any(|x| key(x) == key_o);
            if !dup {
                orders.push(o);
            }
        }
    }
    orders
}

/// Device orders for R replicas of K devices (R x K entries, replica r at rK..(r+1)K): for
/// one replica, [`device_orders`]; for several, the orders of R x K devices, without those
/// that only swap replicas of equal shares, plus for each chosen set the devices dealt out by
/// speed (the R fastest at position 0 of each replica, the next R at position 1, ...). On a
/// cluster of nodes the two differ in the links they cross: the first keeps each replica's
/// stages together (in a node where K fits one), the dealt one keeps the replicas of each
/// stage together (their all-reduce inside a node where R fits one) and sends between stages
/// across nodes; the links decide which is faster.
pub fn replica_orders(model: &CostModel<'_>, r: usize, k: usize) -> Vec<Vec<usize>> {
    let orders = device_orders(model, r * k);
    if r == 1 {
        return orders;
    }
    let specs = model.specs;
    // Each device's kind and node (numbered by first appearance in the whole order, so that
    // rows keep which of them share a node).
    let key = |o: &[usize]| -> Vec<Vec<(u64, u64, usize)>> {
        let nodes = model.links.node_pattern(o);
        let mut rows: Vec<Vec<(u64, u64, usize)>> = o
            .chunks(k)
            .zip(nodes.chunks(k))
            .map(|(row, nodes)| {
                row.iter()
                    .zip(nodes)
                    .map(|(&d, &n)| (specs[d].flops_per_sec.to_bits(), specs[d].memory_bytes, n))
                    .collect()
            })
            .collect();
        // Replicas of equal shares are interchangeable; the first batch % R are larger.
        if model.batch.is_multiple_of(r) {
            rows.sort();
        }
        rows
    };
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut seen: Vec<Vec<Vec<(u64, u64, usize)>>> = Vec::new();
    let mut push = |o: Vec<usize>| {
        let kk = key(&o);
        if !seen.contains(&kk) {
            seen.push(kk);
            out.push(o);
        }
    };
    for o in orders {
        let mut fast = o.clone();
        fast.sort_by(|&a, &b| specs[b].flops_per_sec.total_cmp(&specs[a].flops_per_sec));
        let dealt: Vec<usize> = (0..r)
            .flat_map(|i| (0..k).map(move |d| (i, d)))
            .map(|(i, d)| fast[d * r + i])
            .collect();
        push(o);
        push(dealt);
    }
    out
}

/// Distinct orders of `subset` up to identical devices (at most 24), else four heuristic ones.
fn arrangements(model: &CostModel<'_>, subset: &[usize]) -> Vec<Vec<usize>> {
    let specs = model.specs;
    let same = |a: usize, b: usize| specs[a] == specs[b];
    // Classes of identical devices, each with its members.
    let mut classes: Vec<Vec<usize>> = Vec::new();
    for &d in subset {
        match classes.iter_mut().find(|c| same(c[0], d)) {
            Some(c) => c.push(d),
            None => classes.push(vec![d]),
        }
    }
    let mut count = 1.0;
    let mut placed = 0usize;
    for c in &classes {
        for i in 0..c.len() {
            placed += 1;
            count *= placed as f64 / (i + 1) as f64;
        }
    }
    if count <= 24.0 {
        let mut out = Vec::new();
        let mut left: Vec<usize> = classes.iter().map(Vec::len).collect();
        arrange(&classes, &mut left, &mut Vec::new(), subset.len(), &mut out);
        return out;
    }
    let mut fast = subset.to_vec();
    fast.sort_by(|&a, &b| specs[b].flops_per_sec.total_cmp(&specs[a].flops_per_sec));
    let mut slow = fast.clone();
    slow.reverse();
    let mut roomy = subset.to_vec();
    roomy.sort_by_key(|&d| std::cmp::Reverse(specs[d].memory_bytes));
    vec![subset.to_vec(), fast, slow, roomy]
}

fn arrange(
    classes: &[Vec<usize>],
    left: &mut [usize],
    cur: &mut Vec<usize>,
    k: usize,
    out: &mut Vec<Vec<usize>>,
) {
    if cur.len() == k {
        out.push(cur.clone());
        return;
    }
    for c in 0..classes.len() {
        if left[c] == 0 {
            continue;
        }
        let member = classes[c][classes[c].len() - left[c]];
        left[c] -= 1;
        cur.push(member);
        arrange(classes, left, cur, k, out);
        cur.pop();
        left[c] += 1;
    }
}
