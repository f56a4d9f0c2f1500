//! Skip connections in a layer sequence: a layer stashes named tensors, a later layer pops them
//! (torchgpipe's `@skippable` stash/pop). The names tie the two ends together; a sequence run
//! plainly routes them through a map ([`SkipRouter`]), a pipeline carries them from the
//! producer's stage straight to the consumer's.

use std::collections::HashMap;

use wgpipe_tensor::{Error, Result};

pub use crate::module::Skips;
use crate::module::{ForwardCtx, Module};
use crate::var::Var;

/// One skip of a layer sequence: the layer (global index) that stashes it and the one that pops
/// it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkipEdge {
    pub name: String,
    pub producer: usize,
    pub consumer: usize,
}

/// A layer of a sequence, for error messages: its index and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRef {
    pub index: usize,
    pub name: String,
}

impl std::fmt::Display for LayerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layer {} ({})", self.index, self.name)
    }
}

/// A sequence whose skips do not pair up. Every variant names the layers concerned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkipError {
    #[error("{consumer} pops skip '{name}', which no layer stashes")]
    PopWithoutStash { name: String, consumer: LayerRef },
    #[error("{consumer} pops skip '{name}' before {producer} stashes it")]
    PopBeforeStash {
        name: String,
        consumer: LayerRef,
        producer: LayerRef,
    },
    #[error("{producer} stashes skip '{name}', which no later layer pops")]
    NeverPopped { name: String, producer: LayerRef },
    #[error("{first} and {second} both stash skip '{name}'")]
    DuplicateStash {
        name: String,
        first: LayerRef,
        second: LayerRef,
    },
    #[error("{first} and {second} both pop skip '{name}'")]
    DuplicatePop {
        name: String,
        first: LayerRef,
        second: LayerRef,
    },
}

/// The skips of `layers`, in the order their producers appear (then by name), each checked to
/// have exactly one stash and exactly one later pop.
pub fn resolve_skips(layers: &[Box<dyn Module>]) -> std::result::Result<Vec<SkipEdge>, SkipError> {
    let at = |index: usize| LayerRef {
        index,
        name: layers[index].name(),
    };
    let mut producers: Vec<(String, usize)> = Vec::new();
    let mut consumers: HashMap<String, usize> = HashMap::new();
    for (i, layer) in layers.iter().enumerate() {
        let decl = layer.skips();
        for name in decl.stashes {
            if let Some((_, first)) = producers.iter().find(|(n, _)| *n == name) {
                return Err(SkipError::DuplicateStash {
                    name,
                    first: at(*first),
                    second: at(i),
                });
            }
            producers.push((name, i));
        }
        for name in decl.pops {
            if let Some(&first) = consumers.get(&name) {
                return Err(SkipError::DuplicatePop {
                    name,
                    first: at(first),
                    second: at(i),
                });
            }
            consumers.insert(name, i);
        }
    }
    for (name, &consumer) in &consumers {
        match producers.iter().find(|(n, _)| n == name) {
            None => {
                return Err(SkipError::PopWithoutStash {
                    name: name.clone(),
                    consumer: at(consumer),
                })
            }
            // A layer popping what it stashes itself cannot see it either: the pop is an input.
            Some(&(_, producer)) if producer >= consumer => {
                return Err(SkipError::PopBeforeStash {
                    name: name.clone(),
                    consumer: at(consumer),
                    producer: at(producer),
                })
            }
            Some(_) => {}
        }
    }
    producers
        .into_iter()
        .map(|(name, producer)| match consumers.get(&name) {
            Some(&consumer) => Ok(SkipEdge {
                name,
                producer,
                consumer,
            }),
            None => Err(SkipError::NeverPopped {
                name,
                producer: at(producer),
            }),
        })
        .collect()
}

/// The skips in flight while a sequence (or a piece of it) runs: stashed by name, taken by the
/// layer that pops them.
#[derive(Default)]
pub struct SkipRouter {
    live: HashMap<String, Var>,
}

impl SkipRouter {
    pub fn new() -> Self {
        SkipRouter::default()
    }

    /// Puts a skip in flight (a stash, or one that arrived from another stage).
    pub fn insert(&mut self, name: impl Into<String>, v: Var) {
        self.live.insert(name.into(), v);
    }

    /// Takes a skip out (the consumer of a skip that leaves this piece of the sequence).
    pub fn take(&mut self, name: &str) -> Option<Var> {
        self.live.remove(name)
    }

    /// Runs `layer` on `x`: its pops are taken from the skips in flight and its stashes put in.
    /// `index` names the layer in errors.
    pub fn forward(
        &mut self,
        layer: &dyn Module,
        index: usize,
        x: &Var,
        ctx: &ForwardCtx,
    ) -> Result<Var> {
        let decl = layer.skips();
        if decl.is_empty() {
            return layer.forward(x, ctx);
        }
        let popped = decl
            .pops
            .iter()
            .map(|name| {
                self.live.remove(name).ok_or_else(|| Error::Invalid {
                    op: "skip",
                    msg: format!(
                        "layer {index} ({}) pops skip '{name}', which is not in flight",
                        layer.name()
                    ),
                })
            })
            .collect::<Result<Vec<Var>>>()?;
        let (y, stashed) = layer.forward_skips(x, &popped, ctx)?;
        if stashed.len() != decl.stashes.len() {
            return Err(Error::Invalid {
                op: "skip",
                msg: format!(
                    "layer {index} ({}) declares {} stashes but its forward gave {}",
                    layer.name(),
                    decl.stashes.len(),
                    stashed.len()
                ),
            });
        }
        for (name, v) in decl.stashes.into_iter().zip(stashed) {
            self.live.insert(name, v);
        }
        Ok(y)
    }
}
