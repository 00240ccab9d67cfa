//! Moving a block that snapshots or clones share (the migrator): one copy
//! for everyone who maps the slot, and one `Relocate` record that remaps
//! them all at once (ARCHITECTURE.md, "Migration (tiering)").
//!
//! A slot is only ever mapped at one block number, and only by volumes
//! and snapshots of one *family* (a volume, its snapshots, their clones
//! and theirs, up to the volume nothing was cloned from). So its owners
//! are found by looking at one map page index in each member that has a
//! page of its own there; members without one see the slot through a
//! neighbour and follow the remap by themselves.

use super::*;
use std::sync::Weak;

/// Most owners one `Relocate` record names (it must fit a log block); a
/// slot mapped by more stays where it is.
pub(crate) const MAX_RELOCATE_OWNERS: usize = 512;

impl Pool {
    /// Every volume and snapshot of `volume`'s family.
    pub(crate) fn family(&self, volume: u32) -> Vec<u32> {
        self.snapshots_read().family(volume)
    }

    /// The open engines (volumes, snapshot views) of `family`.
    pub(crate) fn open_engines_in(&self, family: &[u32]) -> Vec<Arc<volume::EngineVolume>> {
        let weak: Vec<Weak<volume::EngineVolume>> = self
            .open_engines
            .lock_or_abort()
            .iter()
            .filter(|(id, _)| family.contains(id))
            .map(|(_, engine)| engine.clone())
            .collect();
        // Upgraded outside the lock: dropping the last reference runs the
        // engine's drop, which must not find the registry locked.
        weak.iter().filter_map(Weak::upgrade).collect()
    }

    /// Remembers an open engine (volume or snapshot view), so that a move
    /// of a shared block can hold off its readers (see [`Pool::relocate`]).
    pub(super) fn register_open_engine(&self, engine: &Arc<volume::EngineVolume>) {
        let mut engines = self.open_engines.lock_or_abort();
        engines.retain(|(_, weak)| weak.strong_count() > 0);
        engines.push((engine.id(), Arc::downgrade(engine)));
    }

    /// The members of `family` whose own map page maps `slot` at `block`,
    /// with those pages.
    fn slot_owners(&self, family: &[u32], block: u64, slot: BlockPtr) -> Result<Vec<(u32, Arc<MapPage>)>, MetaError> {
        let index = block / MAP_ENTRIES_PER_PAGE;
        let within = (block % MAP_ENTRIES_PER_PAGE) as usize;
        let destroyed = self.destroyed.lock_or_abort().clone();
        let mut owners = Vec::new();
        for &id in family {
            if destroyed.contains(&id) {
                continue;
            }
            let page = self.map_pages.get(&self.db, (id, index))?;
            if page.present.load(Ordering::Acquire) && page.ptr(within).same_slot(slot) {
                owners.push((id, page));
            }
        }
        Ok(owners)
    }

    /// Whether any member of `family` maps `slot` at `block` (a move's
    /// first look; [`Pool::relocate`] looks again under its locks).
    pub(crate) fn slot_is_mapped(&self, family: &[u32], block: u64, slot: BlockPtr) -> Result<bool, MetaError> {
        Ok(!self.slot_owners(family, block, slot)?.is_empty())
    }

    /// Remaps every owner of slot `old` at `block` in `volume`'s family to
    /// `new`, which holds a verified copy of its data (checksums `crcs`),
    /// and logs it; `old` is freed by the commit. The caller holds the
    /// write gate and the block's stripes in every engine of the family
    /// that was open (`locked`), so nothing reads or writes the block
    /// meanwhile. Returns `false`, changing nothing, when the move must
    /// wait: an engine of the family opened since (its readers may have
    /// found `old` already), nobody maps `old` any more, or too many do.
    ///
    /// Under the lock of page copies, which snapshot deletions, rollbacks,
    /// promotions and volume destruction take too: who maps the slot
    /// cannot change between the look and the remap, and the log gets the
    /// records in the order the changes were made.
    pub(crate) fn relocate(
        &self,
        volume: u32,
        locked: &[&volume::EngineVolume],
        block: u64,
        old: BlockPtr,
        new: BlockPtr,
        crcs: Vec<u32>,
    ) -> Result<bool, MetaError> {
        let _copying = self.page_copy.lock_or_abort();
        let family = self.family(volume);
        // Held through the remap: an engine opened after it reads the new
        // place.
        let engines = self.open_engines.lock_or_abort();
        let unlocked = engines.iter().any(|(id, engine)| {
            engine.strong_count() > 0
                && family.contains(id)
                && !locked.iter().any(|held| std::ptr::eq(*held, engine.as_ptr()))
        });
        if unlocked {
            return Ok(false);
        }
        let owners = self.slot_owners(&family, block, old)?;
        if owners.is_empty() || owners.len() > MAX_RELOCATE_OWNERS {
            return Ok(false);
        }
        let (Some(from), Some((device, offset))) = (old.place(), new.place()) else {
            return Ok(false);
        };
        let mut stored = crcs.clone();
        self.tag_crcs(&mut stored, block * crcs.len() as u64 * SECTOR_BYTES);
        self.set_crcs(device, offset, &stored)?;
        // Space figures walked while the remap is half done are not kept
        // (`Pool::keep_space`).
        self.relocations.fetch_add(1, Ordering::AcqRel);
        let within = (block % MAP_ENTRIES_PER_PAGE) as usize;
        for (_, page) in &owners {
            self.remap_entry(page, within, old, new);
        }
        self.relocations.fetch_add(1, Ordering::AcqRel);
        drop(engines);
        let record = Record::relocate(block, old, new, crcs, owners.iter().map(|(id, _)| *id).collect());
        self.log.append_free(record, from);
        Ok(true)
    }

    /// Points entry `within` of `page` at `new` if it maps `old`, keeping
    /// its flags.
    fn remap_entry(&self, page: &Arc<MapPage>, within: usize, old: BlockPtr, new: BlockPtr) {
        let entry = page.ptr(within);
        if entry.same_slot(old) {
            page.set_ptr(within, entry.moved_to(new));
            self.map_pages.mark_dirty(page);
        }
    }

    /// A `Relocate` record's remap, replayed (its slots are the caller's).
    /// An owner destroyed since is left out; an entry that no longer maps
    /// `old` (the checkpoint came after the record) is left alone.
    pub(super) fn apply_relocate(
        &self,
        block: u64,
        old: BlockPtr,
        new: BlockPtr,
        owners: &[u32],
    ) -> Result<(), MetaError> {
        let index = block / MAP_ENTRIES_PER_PAGE;
        let within = (block % MAP_ENTRIES_PER_PAGE) as usize;
        let destroyed = self.destroyed.lock_or_abort().clone();
        for owner in owners.iter().filter(|id| !destroyed.contains(id)) {
            let page = self.map_pages.get(&self.db, (*owner, index))?;
            self.remap_entry(&page, within, old, new);
        }
        Ok(())
    }

    /// Whether a remap ran while `seen` was read, or since (the space
    /// figures of a walk that may have seen one half done are not kept).
    pub(super) fn relocated_since(&self, seen: u64) -> bool {
        !seen.is_multiple_of(2) || self.relocations.load(Ordering::Acquire) != seen
    }
}
