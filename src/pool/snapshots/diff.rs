//! Send diffs: the runs of blocks whose contents may differ between two
//! snapshots of a volume (`send -i`, the NBD changed-block context), from
//! their map pages alone. Apart from `space.rs`, which compares the same
//! pages, because it answers a different question: which blocks, not how
//! many.

use super::*;

impl Pool {
    /// The runs of blocks in `first..=last` whose contents may differ
    /// between `older` (a snapshot; `None`: an empty volume) and `newer` (a
    /// later snapshot of the same volume; a volume's writes still in the
    /// RAM cache are not in its map): `(first
    /// block, count)`, in order. A block counts as changed when the two map
    /// it to different slots or only one maps it; a block both map to the
    /// same slot did not change (a slot a snapshot maps is never written in
    /// place). What `send -i` and the NBD changed-block context report.
    /// Reads map pages only, no data.
    pub fn changed_blocks(
        &self,
        older: Option<u32>,
        newer: u32,
        first: u64,
        last: u64,
    ) -> Result<Vec<(u64, u64)>, MetaError> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut block = first;
        while block <= last {
            let end = (block / MAP_ENTRIES_PER_PAGE + 1) * MAP_ENTRIES_PER_PAGE - 1;
            let end = end.min(last);
            let after = self.lookup_range(newer, block, end)?;
            let before = match older {
                Some(older) => self.lookup_range(older, block, end)?,
                None => vec![BlockPtr::NONE; after.len()],
            };
            for (i, (a, b)) in after.iter().zip(&before).enumerate() {
                if !a.differs_from(*b) {
                    continue;
                }
                let at = block + i as u64;
                match runs.last_mut() {
                    Some((start, count)) if *start + *count == at => *count += 1,
                    _ => runs.push((at, 1)),
                }
            }
            block = end + 1;
        }
        Ok(runs)
    }
}
