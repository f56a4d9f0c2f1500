//! The simulated cluster: K virtual accelerators for CI and planning.
//!
//! Each virtual device does its arithmetic on a real backing device (the CPU or a wgpu adapter
//! such as lavapipe), but has its own memory accounting with an enforced capacity (going past it
//! is an `OutOfMemory` error for that stage), its own FLOP counter, a compute rate and links to
//! the others: one kind of link in a one-level cluster, or, in a cluster of nodes, a fast link
//! inside a node and a slower one between nodes ([`Topology`]). The pipeline turns the FLOPs and bytes it measured into a deterministic
//! simulated timeline (`timeline::simulate`); those times are always labelled simulated.

use wgpipe_tensor::Device;

use crate::sim::timeline::{DeviceSpec, LinkSpec};
use crate::sim::topology::{Topology, TopologyError};

/// K virtual devices with their specs and the links between them.
#[derive(Clone, Debug)]
pub struct SimCluster {
    devices: Vec<Device>,
    specs: Vec<DeviceSpec>,
    links: Topology,
}

impl SimCluster {
    /// `k` identical virtual devices on `backing`, each with `memory_bytes` of memory and
    /// `flops_per_sec` of compute, joined by `link`.
    pub fn uniform(
        backing: &Device,
        k: usize,
        memory_bytes: u64,
        flops_per_sec: f64,
        link: LinkSpec,
    ) -> SimCluster {
        let specs = vec![
            DeviceSpec {
                flops_per_sec,
                memory_bytes
            };
            k
        ];
        SimCluster::new(backing, &specs, link)
    }

    /// One virtual device per spec, named `sim0`, `sim1`, ..., every pair joined by `link`.
    pub fn new(backing: &Device, specs: &[DeviceSpec], link: LinkSpec) -> SimCluster {
        SimCluster::with_topology(backing, specs, Topology::flat(link))
    }

    /// One virtual device per spec in nodes of `node_size` (devices 0..node_size form node 0,
    /// and so on), joined by `intra` inside a node and by `inter` between nodes. An error when
    /// the devices do not make whole nodes.
    pub fn nodes(
        backing: &Device,
        specs: &[DeviceSpec],
        node_size: usize,
        intra: LinkSpec,
        inter: LinkSpec,
    ) -> Result<SimCluster, TopologyError> {
        let links = Topology::nodes(specs.len(), node_size, intra, inter)?;
        SimCluster::on(backing, specs, links)
    }

    /// One virtual device per spec, joined as `links` says (an error when it places another
    /// number of devices).
    pub fn on(
        backing: &Device,
        specs: &[DeviceSpec],
        links: Topology,
    ) -> Result<SimCluster, TopologyError> {
        links.check_devices(specs.len())?;
        Ok(SimCluster::with_topology(backing, specs, links))
    }

    fn with_topology(backing: &Device, specs: &[DeviceSpec], links: Topology) -> SimCluster {
        let devices = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let cap = (s.memory_bytes != u64::MAX).then_some(s.memory_bytes as usize);
                backing.virtual_device(&format!("sim{i}"), cap)
            })
            .collect();
        SimCluster {
            devices,
            specs: specs.to_vec(),
            links,
        }
    }

    /// The devices `order` names, in that order (the same virtual devices, not copies): the
    /// cluster a plan runs on.
    pub fn select(&self, order: &[usize]) -> SimCluster {
        SimCluster {
            devices: order.iter().map(|&d| self.devices[d].clone()).collect(),
            specs: order.iter().map(|&d| self.specs[d]).collect(),
            links: self.links.select(order),
        }
    }

    /// The devices `range` of this cluster as a cluster of their own (one replica's share).
    pub(crate) fn part(&self, range: std::ops::Range<usize>) -> SimCluster {
        self.select(&range.collect::<Vec<_>>())
    }

    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
    pub fn specs(&self) -> &[DeviceSpec] {
        &self.specs
    }
    /// The link inside a node: the only one of a one-level cluster.
    pub fn link(&self) -> LinkSpec {
        self.links.intra()
    }
    /// Which link joins which devices.
    pub fn topology(&self) -> &Topology {
        &self.links
    }
    pub fn len(&self) -> usize {
        self.devices.len()
    }
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}
