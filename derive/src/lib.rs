//! `#[derive(Module)]`: a layer whose parameters are declared once, as its fields.
//!
//! The derive writes the `Module` impl of a struct that has an inherent method
//! `fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var>`: its name, its parameters and
//! buffers gathered from its fields (named as the fields are, so checkpoints key on them), and
//! train mode and end-of-step updates passed on to its child modules. The cost is
//! `Module::cost`'s default (measured by running the layer once). Fields:
//!
//! - `Param`, `Option<Param>`, `Vec<Param>`: parameters named `field` (`field.i` in a `Vec`);
//! - `#[wgpipe(buffer)]` on such a field: a buffer (saved with the model, not trained);
//! - `#[wgpipe(module)]` on a field of a `Module` type, `Option` of one, `Vec` of them, or
//!   `Box<dyn Module>` in any of these: a child, its parameters named `field.name`
//!   (`field.i.name` in a `Vec`);
//! - `#[wgpipe(rename = "name")]`: the name to use instead of the field's (e.g. a checkpoint's
//!   `self_attn` for a field `attn`);
//! - any other field (sizes, options) is not part of the module's state.
//!
//! `#[wgpipe(crate = "path")]` on the struct names the autograd crate when the derive cannot
//! find it (it looks for `wgpipe-autograd`, then `wgpipe`, in the calling crate's Cargo.toml).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::{parse_macro_input, Data, DeriveInput, Fields, GenericArgument, LitStr, PathArguments};

#[proc_macro_derive(Module, attributes(wgpipe))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// What a field is to the module.
enum Role {
    Param,
    Buffer,
    Child,
}

/// How many of it the field holds.
enum Arity {
    One,
    Optional,
    Many,
}

struct Field {
    ident: syn::Ident,
    name: String,
    role: Role,
    arity: Arity,
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let krate = autograd_path(input)?;
    let fields = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(named) => named
                .named
                .iter()
                .map(classify)
                .filter_map(Result::transpose)
                .collect::<syn::Result<Vec<Field>>>()?,
            Fields::Unit => Vec::new(),
            Fields::Unnamed(_) => {
                return Err(syn::Error::new_spanned(
                    &input.ident,
                    "#[derive(Module)] needs named fields: parameters are named after them",
                ))
            }
        },
        _ => {
            return Err(syn::Error::new_spanned(
                &input.ident,
                "#[derive(Module)] works on structs",
            ))
        }
    };
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let params = gather(&fields, &krate, |r| matches!(r, Role::Param), false);
    let buffers = gather(&fields, &krate, |r| matches!(r, Role::Buffer), true);
    let children = fields
        .iter()
        .filter(|f| matches!(f.role, Role::Child))
        .collect::<Vec<_>>();
    let set_train = children.iter().map(|f| {
        let id = &f.ident;
        let each = quote!(#krate::module::AsModule::as_module_mut(m).set_train(train););
        match f.arity {
            Arity::One => quote!({ let m = &mut self.#id; #each }),
            Arity::Optional => quote!(if let Some(m) = &mut self.#id { #each }),
            Arity::Many => quote!(for m in self.#id.iter_mut() { #each }),
        }
    });
    let finish_step = children.iter().map(|f| {
        let id = &f.ident;
        let each = quote!(#krate::module::AsModule::as_module(m).finish_step()?;);
        match f.arity {
            Arity::One => quote!({ let m = &self.#id; #each }),
            Arity::Optional => quote!(if let Some(m) = &self.#id { #each }),
            Arity::Many => quote!(for m in self.#id.iter() { #each }),
        }
    });
    let name = ident.to_string();
    let guard = format_ident!("MissingInherentForwardOn{}", ident);
    Ok(quote! {
        impl #impl_generics #krate::Module for #ident #ty_generics #where_clause {
            fn name(&self) -> ::std::string::String {
                #name.to_string()
            }
            fn forward(
                &self,
                x: &#krate::Var,
                ctx: &#krate::ForwardCtx,
            ) -> #krate::tensor::Result<#krate::Var> {
                // The struct's own `forward`. Without one this call would be this very method,
                // an endless recursion: the trait below makes it ambiguous, a compile error.
                #[allow(dead_code, non_camel_case_types)]
                trait #guard {
                    fn forward(&self);
                }
                impl #impl_generics #guard for #ident #ty_generics #where_clause {
                    fn forward(&self) {}
                }
                Self::forward(self, x, ctx)
            }
            fn parameters(&self) -> ::std::vec::Vec<(::std::string::String, #krate::Param)> {
                #params
            }
            fn buffers(&self) -> ::std::vec::Vec<(::std::string::String, #krate::Param)> {
                #buffers
            }
            fn set_train(&mut self, train: bool) {
                #(#set_train)*
            }
            fn finish_step(&self) -> #krate::tensor::Result<()> {
                #(#finish_step)*
                Ok(())
            }
        }
    })
}

/// A `ParamList` of the fields whose role `wanted` picks, and of the children's parameters
/// (or buffers, when `buffers`).
fn gather(
    fields: &[Field],
    krate: &Tokens,
    wanted: impl Fn(&Role) -> bool,
    buffers: bool,
) -> Tokens {
    let steps = fields.iter().filter_map(|f| {
        let id = &f.ident;
        let name = &f.name;
        if wanted(&f.role) {
            return Some(match f.arity {
                Arity::One => quote!(let list = list.param(#name, &self.#id);),
                Arity::Optional => quote!(let list = list.opt(#name, self.#id.as_ref());),
                Arity::Many => quote! {
                    let list = self.#id.iter().enumerate().fold(list, |list, (i, p)| {
                        list.param(&::std::format!("{}.{}", #name, i), p)
                    });
                },
            });
        }
        if !matches!(f.role, Role::Child) {
            return None;
        }
        let add = if buffers {
            quote!(child_buffers)
        } else {
            quote!(child)
        };
        let as_module = quote!(#krate::module::AsModule::as_module);
        Some(match f.arity {
            Arity::One => quote!(let list = list.#add(#name, #as_module(&self.#id));),
            Arity::Optional => quote! {
                let list = match &self.#id {
                    Some(m) => list.#add(#name, #as_module(m)),
                    None => list,
                };
            },
            Arity::Many => quote! {
                let list = self.#id.iter().enumerate().fold(list, |list, (i, m)| {
                    list.#add(&::std::format!("{}.{}", #name, i), #as_module(m))
                });
            },
        })
    });
    quote! {
        let list = #krate::module::ParamList::new();
        #(#steps)*
        list.into()
    }
}

/// The field's role from its attributes and type; `None` for a field that is not state.
fn classify(field: &syn::Field) -> syn::Result<Option<Field>> {
    let ident = field.ident.clone().expect("named fields");
    let (mut module, mut buffer, mut rename) = (false, false, None);
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("wgpipe")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("module") {
                module = true;
            } else if meta.path.is_ident("buffer") {
                buffer = true;
            } else if meta.path.is_ident("rename") {
                rename = Some(meta.value()?.parse::<LitStr>()?.value());
            } else {
                return Err(meta.error("expected `module`, `buffer` or `rename = \"name\"`"));
            }
            Ok(())
        })?;
    }
    let name = rename.unwrap_or_else(|| ident.to_string());
    let (arity, inner) = arity_of(&field.ty);
    if module {
        if buffer {
            return Err(syn::Error::new_spanned(
                &ident,
                "a field is a module or a buffer, not both",
            ));
        }
        return Ok(Some(Field {
            ident,
            name,
            role: Role::Child,
            arity,
        }));
    }
    if !last_segment_is(inner, "Param") {
        if buffer {
            return Err(syn::Error::new_spanned(
                &field.ty,
                "#[wgpipe(buffer)] needs a Param, Option<Param> or Vec<Param> field",
            ));
        }
        return Ok(None);
    }
    let role = if buffer { Role::Buffer } else { Role::Param };
    Ok(Some(Field {
        ident,
        name,
        role,
        arity,
    }))
}

/// `Option<T>` and `Vec<T>` as their arity and `T`; any other type as itself, once.
fn arity_of(ty: &syn::Type) -> (Arity, &syn::Type) {
    for (wrapper, arity) in [("Option", Arity::Optional), ("Vec", Arity::Many)] {
        if let Some(inner) = single_argument(ty, wrapper) {
            return (arity, inner);
        }
    }
    (Arity::One, ty)
}

/// `T` of a type `Wrapper<T>` (by the path's last segment).
fn single_argument<'a>(ty: &'a syn::Type, wrapper: &str) -> Option<&'a syn::Type> {
    let syn::Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != wrapper {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first() {
        Some(GenericArgument::Type(t)) if args.args.len() == 1 => Some(t),
        _ => None,
    }
}

fn last_segment_is(ty: &syn::Type, name: &str) -> bool {
    matches!(ty, syn::Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == name))
}

/// The path the generated code names the autograd crate by: `#[wgpipe(crate = "...")]`, else
/// `::wgpipe_autograd` where the calling crate's Cargo.toml names `wgpipe-autograd` (a
/// dependency, or the package itself for its tests and doc tests), else `::wgpipe::autograd`
/// (the facade).
fn autograd_path(input: &DeriveInput) -> syn::Result<Tokens> {
    let mut given = None;
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("wgpipe")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                given = Some(meta.value()?.parse::<LitStr>()?.parse::<syn::Path>()?);
                Ok(())
            } else {
                Err(meta.error("expected `crate = \"path\"`"))
            }
        })?;
    }
    if let Some(path) = given {
        return Ok(quote!(#path));
    }
    let manifest = std::env::var("CARGO_MANIFEST_DIR")
        .ok()
        .and_then(|dir| std::fs::read_to_string(std::path::Path::new(&dir).join("Cargo.toml")).ok())
        .unwrap_or_default();
    if manifest.contains("wgpipe-autograd") {
        Ok(quote!(::wgpipe_autograd))
    } else {
        Ok(quote!(::wgpipe::autograd))
    }
}
