//! Row reductions: the op names and their WGSL parts (the CPU loops live in the tensor crate's
//! CPU backend, which has one tuned loop per family rather than one per op).

/// Row reductions. `ArgMax`/`ArgMin` give the first index of the extreme value, as f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    ArgMax,
    ArgMin,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::ArgMax,
        ReduceOp::ArgMin,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }

    /// The WGSL of `reduce.wgsl`'s placeholders: (the neutral value, the body of
    /// `combine(a: Acc, b: Acc) -> Acc`, the result of `best: Acc`).
    pub fn wgsl(self) -> (&'static str, &'static str, &'static str) {
        const INF: &str = "bitcast<f32>(0x7f800000u)";
        const NEG_INF: &str = "bitcast<f32>(0xff800000u)";
        match self {
            ReduceOp::Sum => ("0.0", "return Acc(a.v + b.v, 0u);", "best.v"),
            ReduceOp::Max => (
                NEG_INF,
                "if (b.v > a.v) { return b; }\n    return a;",
                "best.v",
            ),
            ReduceOp::Min => (INF, "if (b.v < a.v) { return b; }\n    return a;", "best.v"),
            ReduceOp::ArgMax => (
                NEG_INF,
                "if (b.v > a.v || (b.v == a.v && b.i < a.i)) { return b; }\n    return a;",
                "f32(best.i)",
            ),
            ReduceOp::ArgMin => (
                INF,
                "if (b.v < a.v || (b.v == a.v && b.i < a.i)) { return b; }\n    return a;",
                "f32(best.i)",
            ),
        }
    }
}
