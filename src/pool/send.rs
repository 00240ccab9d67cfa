//! What `send` needs from the engine: the plan of a stream (which blocks
//! to send as data, which as holes), and whether a volume changed since
//! its newest snapshot (an incremental receive writes only into a volume
//! that did not). Map pages only, no data read.

use super::*;

/// One part of a send stream's plan: `count` blocks from `first`, mapped
/// by the snapshot (sent as data) or not (a hole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendExtent {
    pub first: u64,
    pub count: u64,
    pub mapped: bool,
}

type Extent = SendExtent;

impl Pool {
    /// The extents a stream from `older` (a snapshot; `None`: an empty
    /// volume) to snapshot `newer` covers, in order, for a volume of
    /// `blocks` blocks: the runs of [`Pool::changed_blocks`], cut where
    /// `newer` starts or stops mapping blocks (mapped: sent as data;
    /// unmapped: a hole the receiver unmaps).
    pub fn send_extents(&self, older: Option<u32>, newer: u32, blocks: u64) -> Result<Vec<Extent>, MetaError> {
        let mut extents: Vec<Extent> = Vec::new();
        if blocks == 0 {
            return Ok(extents);
        }
        for (first, count) in self.changed_blocks(older, newer, 0, blocks - 1)? {
            let entries = self.lookup_range(newer, first, first + count - 1)?;
            for (i, entry) in entries.iter().enumerate() {
                let mapped = entry.is_mapped();
                let block = first + i as u64;
                match extents.last_mut() {
                    Some(last) if last.first + last.count == block && last.mapped == mapped => last.count += 1,
                    _ => extents.push(Extent {
                        first: block,
                        count: 1,
                        mapped,
                    }),
                }
            }
        }
        Ok(extents)
    }

    /// Whether `volume` differs from `snapshot` (its newest): a write
    /// still in the RAM cache was made after it (those from before it
    /// belong to it as well as to the volume), or a block maps differently.
    pub fn changed_since(&self, volume: &volume::EngineVolume, snapshot: u32) -> Result<bool, MetaError> {
        let floor = self.snapshot(snapshot).map_or(0, |s| s.cache_seq);
        if !volume.cached_blocks(|e| e.seq >= floor, 1).is_empty() {
            return Ok(true);
        }
        let blocks = crate::block::BlockDevice::size_bytes(volume).div_ceil(volume.volblocksize() as u64);
        if blocks == 0 {
            return Ok(false);
        }
        Ok(!self
            .changed_blocks(Some(snapshot), volume.id(), 0, blocks - 1)?
            .is_empty())
    }
}
