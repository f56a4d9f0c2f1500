//! Parses and validates every kernel variant with naga (no GPU needed), so a typo in a shader
//! or a template fails `cargo test`.

use naga::valid::{Capabilities, ValidationFlags, Validator};
use wgpipe_shaders::{Access, Kernel};

fn validate(k: &Kernel) -> Result<naga::Module, String> {
    let src = k.source();
    let module = naga::front::wgsl::parse_str(&src)
        .map_err(|e| format!("{k:?}: parse error:\n{}", e.emit_to_string(&src)))?;
    let caps = if k.needs_subgroups() {
        Capabilities::SUBGROUP
    } else {
        Capabilities::empty()
    };
    Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| format!("{k:?}: validation error: {e:?}\n{src}"))?;
    Ok(module)
}

#[test]
fn every_variant_parses_and_validates() {
    let all = Kernel::all();
    assert!(all.len() > 100, "only {} variants", all.len());
    let errors: Vec<String> = all.iter().filter_map(|k| validate(k).err()).collect();
    assert!(
        errors.is_empty(),
        "{} of {} variants failed:\n{}",
        errors.len(),
        all.len(),
        errors.join("\n\n")
    );
}

#[test]
fn entry_points_and_bindings_match_the_source() {
    for k in Kernel::all() {
        let module = validate(&k).unwrap();
        assert!(
            module
                .entry_points
                .iter()
                .any(|e| e.name == k.entry_point()),
            "{k:?}: no entry point {}",
            k.entry_point()
        );
        for (binding, access) in k.bindings() {
            let var = module
                .global_variables
                .iter()
                .map(|(_, v)| v)
                .find(|v| v.binding.as_ref().map(|b| (b.group, b.binding)) == Some((0, binding)))
                .unwrap_or_else(|| panic!("{k:?}: no variable at binding {binding}"));
            let read_only = matches!(
                var.space,
                naga::AddressSpace::Storage { access } if !access.contains(naga::StorageAccess::STORE)
            );
            assert_eq!(read_only, access == Access::Read, "{k:?} binding {binding}");
        }
    }
}
