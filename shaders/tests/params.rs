//! Each kernel's WGSL parameter block (binding 0) has the layout of the `#[repr(C)]` struct of
//! the same name in `wgpipe_shaders::params`: same members, in order, at the same offsets, of
//! the same sizes and scalar kinds; a trailing `dims: array<u32>` exactly where the Rust struct
//! says it has one.

use naga::{Module, ScalarKind, TypeInner};
use wgpipe_shaders::params::{self, Field};
use wgpipe_shaders::Kernel;

/// One WGSL struct member: name, offset, size (0 for a run-time sized array), scalar kind.
type Member = (String, u32, u32, Option<ScalarKind>);

/// The struct bound at binding 0: its name and members.
fn binding0(module: &Module) -> (String, Vec<Member>) {
    let var = module
        .global_variables
        .iter()
        .map(|(_, v)| v)
        .find(|v| v.binding.as_ref().map(|b| (b.group, b.binding)) == Some((0, 0)))
        .expect("a variable at binding 0");
    let ty = &module.types[var.ty];
    let TypeInner::Struct { members, .. } = &ty.inner else {
        panic!("binding 0 is not a struct: {:?}", ty.inner);
    };
    let gctx = module.to_ctx();
    let fields = members
        .iter()
        .map(|m| {
            let inner = &module.types[m.ty].inner;
            let kind = match inner {
                TypeInner::Scalar(s) => Some(s.kind),
                _ => None,
            };
            let size = match inner {
                TypeInner::Array { .. } => 0,
                other => other.size(gctx),
            };
            (m.name.clone().unwrap_or_default(), m.offset, size, kind)
        })
        .collect();
    (ty.name.clone().unwrap_or_default(), fields)
}

#[test]
fn wgsl_parameter_blocks_match_the_rust_structs() {
    let mut seen = std::collections::BTreeSet::new();
    for k in Kernel::all() {
        let src = k.source();
        let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| panic!("{k:?}: {e}"));
        let (name, wgsl) = binding0(&module);
        assert_eq!(name, k.params(), "{k:?}: binding 0 is {name}");
        let &(_, fields, has_dims) = params::ALL
            .iter()
            .find(|(n, _, _)| *n == name)
            .unwrap_or_else(|| panic!("{k:?}: no Rust struct {name} in params::ALL"));
        let fixed = &wgsl[..fields.len().min(wgsl.len())];
        let rust: Vec<(String, u32, u32)> = fields
            .iter()
            .map(|&Field { name, offset, size }| (name.to_string(), offset as u32, size as u32))
            .collect();
        let got: Vec<(String, u32, u32)> = fixed
            .iter()
            .map(|(n, o, s, _)| (n.clone(), *o, *s))
            .collect();
        assert_eq!(got, rust, "{k:?}: {name} differs between WGSL and Rust");
        // Every fixed member is a 4-byte scalar, as the Rust side writes them.
        for (n, _, _, kind) in fixed {
            assert!(kind.is_some(), "{k:?}: {name}.{n} is not a scalar");
        }
        let end = fields.last().map(|f| f.offset + f.size).unwrap_or(0) as u32;
        if has_dims {
            assert_eq!(wgsl.len(), fields.len() + 1, "{k:?}: {name} lacks dims");
            let (n, o, _, _) = &wgsl[fields.len()];
            assert_eq!((n.as_str(), *o), ("dims", end), "{k:?}: {name}.dims");
        } else {
            assert_eq!(wgsl.len(), fields.len(), "{k:?}: {name} has extra members");
        }
        seen.insert(name);
    }
    // Every Rust block is used by some kernel.
    for (n, _, _) in params::ALL {
        assert!(seen.contains(*n), "{n} is used by no kernel");
    }
}

/// Scalar kinds: the Rust field types (u32 / f32) against the WGSL ones, for the blocks that
/// carry floats (a u32 read as f32 would be silently wrong).
#[test]
fn float_members_are_floats() {
    use params::*;
    let float_fields: &[(&str, &[&str])] = &[
        (FillParams::NAME, &["value"]),
        (EwParams::NAME, &["s0", "s1"]),
        (SoftmaxParams::NAME, &["scale"]),
        (SoftmaxBackwardParams::NAME, &["scale"]),
        (LayerNormParams::NAME, &["eps"]),
        (DropoutParams::NAME, &["p", "scale"]),
        (
            AdamParams::NAME,
            &["lr", "beta1", "beta2", "eps", "weight_decay", "bc1", "bc2"],
        ),
    ];
    for k in Kernel::all() {
        let module = naga::front::wgsl::parse_str(&k.source()).unwrap();
        let (name, wgsl) = binding0(&module);
        let floats = float_fields
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| *f)
            .unwrap_or(&[]);
        for (n, _, _, kind) in wgsl.iter().filter(|m| m.3.is_some()) {
            let want = if floats.contains(&n.as_str()) {
                ScalarKind::Float
            } else {
                ScalarKind::Uint
            };
            assert_eq!(*kind, Some(want), "{k:?}: {name}.{n}");
        }
    }
}
