//! Op front-ends: validation and lowering to backend kernels.
