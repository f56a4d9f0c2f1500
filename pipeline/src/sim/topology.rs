//! Which link a transfer crosses: devices grouped in nodes, a fast link between two devices of
//! one node and a slower one between nodes (NVLink inside a server, the network between
//! servers).
//!
//! Each device is taken to have its own link to every other device (one per direction), inside
//! its node and out of it, as on servers with one network card per accelerator: transfers of
//! different devices do not share a link, so a link is priced by its own bandwidth and latency
//! alone. A one-level cluster is the special case of a single node, where every transfer takes
//! the one link there is.

use crate::sim::timeline::LinkSpec;

/// The links of a cluster of nodes. Indexed by device: after [`Topology::select`], by the
/// selected devices' positions.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    intra: LinkSpec,
    inter: LinkSpec,
    /// The node of each device; empty when every device is in one node (the one-level cluster,
    /// of any size).
    node_of: Vec<usize>,
}

/// Why a topology cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TopologyError {
    #[error("a node must hold at least one device (node size 0 given)")]
    EmptyNode,
    #[error(
        "{devices} devices do not make whole nodes of {node_size}: the device count must be a \
         multiple of the node size"
    )]
    NotMultiple { devices: usize, node_size: usize },
    #[error("the topology places {topology} devices in nodes, but the cluster has {devices}")]
    DeviceCount { topology: usize, devices: usize },
}

impl Topology {
    /// One node: every transfer crosses `link`.
    pub fn flat(link: LinkSpec) -> Topology {
        Topology {
            intra: link,
            inter: link,
            node_of: Vec::new(),
        }
    }

    /// `devices` devices in nodes of `node_size` (devices 0..node_size form node 0, and so
    /// on), joined by `intra` inside a node and `inter` between nodes.
    pub fn nodes(
        devices: usize,
        node_size: usize,
        intra: LinkSpec,
        inter: LinkSpec,
    ) -> Result<Topology, TopologyError> {
        if node_size == 0 {
            return Err(TopologyError::EmptyNode);
        }
        if !devices.is_multiple_of(node_size) {
            return Err(TopologyError::NotMultiple { devices, node_size });
        }
        Ok(Topology {
            intra,
            inter,
            node_of: (0..devices).map(|d| d / node_size).collect(),
        })
    }

    /// Whether the topology can join `devices` devices: a one-level one joins any number, one
    /// of nodes exactly the devices it placed.
    pub fn check_devices(&self, devices: usize) -> Result<(), TopologyError> {
        if self.node_of.is_empty() || self.node_of.len() == devices {
            Ok(())
        } else {
            Err(TopologyError::DeviceCount {
                topology: self.node_of.len(),
                devices,
            })
        }
    }

    /// The link inside a node (the only one of a one-level cluster).
    pub fn intra(&self) -> LinkSpec {
        self.intra
    }

    /// The link between nodes.
    pub fn inter(&self) -> LinkSpec {
        self.inter
    }

    /// Whether every device is in one node.
    pub fn is_flat(&self) -> bool {
        self.node_of.iter().all(|&n| n == self.node_of[0])
    }

    /// The node of device `d` (one of the devices this topology placed, unless it is flat).
    pub fn node(&self, d: usize) -> usize {
        if self.node_of.is_empty() {
            0
        } else {
            self.node_of[d]
        }
    }

    /// The link from device `from` to device `to`.
    pub fn link(&self, from: usize, to: usize) -> LinkSpec {
        if self.node(from) == self.node(to) {
            self.intra
        } else {
            self.inter
        }
    }

    /// The link that bounds a ring collective (all-reduce) over `devices`: every step of a
    /// ring moves one piece on every hop at once and waits for the slowest hop, so a ring that
    /// leaves a node runs at the inter-node link's speed (the slower of the two, should the
    /// inter-node one be the faster).
    pub fn ring_link(&self, devices: impl IntoIterator<Item = usize>) -> LinkSpec {
        let mut nodes = devices.into_iter().map(|d| self.node(d));
        let Some(first) = nodes.next() else {
            return self.intra;
        };
        if nodes.all(|n| n == first) {
            self.intra
        } else {
            slower(self.intra, self.inter)
        }
    }

    /// The fastest link any ring of `devices` devices can have: the link inside a node when
    /// that many fit in one node, else a link that leaves a node.
    pub fn fastest_ring(&self, devices: usize) -> LinkSpec {
        let mut per_node: Vec<usize> = Vec::new();
        for &n in &self.node_of {
            if per_node.len() <= n {
                per_node.resize(n + 1, 0);
            }
            per_node[n] += 1;
        }
        let largest = per_node.iter().copied().max().unwrap_or(usize::MAX);
        if self.node_of.is_empty() || devices <= largest {
            faster(self.intra, self.inter)
        } else {
            slower(self.intra, self.inter)
        }
    }

    /// The devices `order` names, in that order, as a topology of their own (device i of the
    /// result is device `order[i]` here).
    pub fn select(&self, order: &[usize]) -> Topology {
        Topology {
            intra: self.intra,
            inter: self.inter,
            node_of: if self.node_of.is_empty() {
                Vec::new()
            } else {
                order.iter().map(|&d| self.node(d)).collect()
            },
        }
    }

    /// The devices of `parts` (each a topology and its device count) one after the other,
    /// each in its node: parts selected from one topology, as replicas' clusters are from the
    /// whole cluster. Flat when every part is (links from the first part).
    pub fn concat(parts: &[(&Topology, usize)]) -> Topology {
        let Some(&(first, _)) = parts.first() else {
            return Topology::flat(crate::sim::timeline::LinkSpec::FREE);
        };
        if parts.iter().all(|(p, _)| p.node_of.is_empty()) {
            return first.clone();
        }
        let node_of = parts
            .iter()
            .flat_map(|&(p, n)| (0..n).map(move |d| p.node(d)))
            .collect();
        Topology {
            intra: first.intra,
            inter: first.inter,
            node_of,
        }
    }

    /// The nodes of `order`'s devices renumbered by first appearance: two orders with the same
    /// pattern (and the same device specs) cross the same links, so they cost the same.
    pub fn node_pattern(&self, order: &[usize]) -> Vec<usize> {
        let mut seen: Vec<usize> = Vec::new();
        order
            .iter()
            .map(|&d| {
                let n = self.node(d);
                seen.iter().position(|&x| x == n).unwrap_or_else(|| {
                    seen.push(n);
                    seen.len() - 1
                })
            })
            .collect()
    }
}

/// The higher bandwidth and the lower latency of two links.
fn faster(a: LinkSpec, b: LinkSpec) -> LinkSpec {
    LinkSpec {
        bandwidth_bytes_per_sec: a.bandwidth_bytes_per_sec.max(b.bandwidth_bytes_per_sec),
        latency_sec: a.latency_sec.min(b.latency_sec),
    }
}

/// The lower bandwidth and the higher latency of two links.
fn slower(a: LinkSpec, b: LinkSpec) -> LinkSpec {
    LinkSpec {
        bandwidth_bytes_per_sec: a.bandwidth_bytes_per_sec.min(b.bandwidth_bytes_per_sec),
        latency_sec: a.latency_sec.max(b.latency_sec),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: LinkSpec = LinkSpec {
        bandwidth_bytes_per_sec: 300e9,
        latency_sec: 1e-6,
    };
    const SLOW: LinkSpec = LinkSpec {
        bandwidth_bytes_per_sec: 25e9,
        latency_sec: 5e-6,
    };

    #[test]
    fn links_follow_nodes() {
        let t = Topology::nodes(16, 8, FAST, SLOW).unwrap();
        assert_eq!(t.link(0, 7), FAST);
        assert_eq!(t.link(7, 8), SLOW);
        assert_eq!(t.ring_link([0, 3, 5]), FAST);
        assert_eq!(t.ring_link([0, 8]), SLOW);
        // Selecting devices keeps their nodes: devices 7 and 8 are now 0 and 1.
        let s = t.select(&[7, 8, 6]);
        assert_eq!(s.link(0, 1), SLOW);
        assert_eq!(s.link(0, 2), FAST);
        assert_eq!(t.node_pattern(&[9, 1, 10, 2]), vec![0, 1, 0, 1]);
        assert!(!t.is_flat() && s.select(&[0, 2]).is_flat());
        // Replicas' parts put back together keep their nodes.
        let whole = Topology::concat(&[(&t.select(&[0, 1]), 2), (&t.select(&[8, 9]), 2)]);
        assert_eq!(whole.ring_link([0, 2]), SLOW);
        assert_eq!(whole.ring_link([2, 3]), FAST);
    }

    #[test]
    fn flat_is_one_node_of_any_size() {
        let t = Topology::flat(SLOW);
        assert_eq!(t.link(0, 1000), SLOW);
        assert_eq!(t.ring_link(0..64), SLOW);
        assert!(t.is_flat());
    }

    #[test]
    fn errors_name_what_was_wrong() {
        let e = Topology::nodes(12, 8, FAST, SLOW).unwrap_err();
        assert_eq!(
            e,
            TopologyError::NotMultiple {
                devices: 12,
                node_size: 8
            }
        );
        assert!(e.to_string().contains("multiple of the node size"), "{e}");
        assert_eq!(
            Topology::nodes(8, 0, FAST, SLOW).unwrap_err(),
            TopologyError::EmptyNode
        );
    }
}
