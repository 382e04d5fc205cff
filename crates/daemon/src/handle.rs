//! Handle tables: index + generation, so a stale or forged handle is caught, never aliased.
//!
//! A handle is `generation << 32 | index`; generations start at 1, so 0 is never a handle, and a
//! slot's generation grows each time it is freed.

/// A table of `T` addressed by handles.
#[derive(Debug)]
pub(crate) struct HandleTable<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
    limit: usize,
}

#[derive(Debug)]
struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

impl<T> HandleTable<T> {
    pub(crate) fn new(limit: usize) -> Self {
        HandleTable {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            limit,
        }
    }

    /// Inserts `value`; `None` when the table is at its limit.
    pub(crate) fn insert(&mut self, value: T) -> Option<u64> {
        if self.live >= self.limit {
            return None;
        }
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    generation: 1,
                    value: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.value = Some(value);
        self.live += 1;
        Some(u64::from(slot.generation) << 32 | u64::from(index))
    }

    /// Inserts `value` under `handle` as an earlier table gave it out (a resumed session keeps
    /// its handles, so the descriptors its client builds stay valid). `Err` with the reason when
    /// the handle is malformed, beyond the limit, or taken. Slots skipped on the way become free.
    pub(crate) fn insert_at(&mut self, handle: u64, value: T) -> Result<(), &'static str> {
        let index = (handle & 0xffff_ffff) as usize;
        let generation = (handle >> 32) as u32;
        if generation == 0 {
            return Err("generation 0 is never a handle");
        }
        if index >= self.limit || self.live >= self.limit {
            return Err("beyond the daemon's limit");
        }
        while self.slots.len() <= index {
            self.free.push(self.slots.len() as u32);
            self.slots.push(Slot {
                generation: 1,
                value: None,
            });
        }
        if self.slots[index].value.is_some() {
            return Err("given twice");
        }
        self.free.retain(|&i| i as usize != index);
        let slot = &mut self.slots[index];
        slot.generation = generation;
        slot.value = Some(value);
        self.live += 1;
        Ok(())
    }

    fn slot(&self, handle: u64) -> Option<&Slot<T>> {
        let index = (handle & 0xffff_ffff) as usize;
        let generation = (handle >> 32) as u32;
        self.slots
            .get(index)
            .filter(|s| s.generation == generation && s.value.is_some())
    }

    pub(crate) fn get(&self, handle: u64) -> Option<&T> {
        self.slot(handle).and_then(|s| s.value.as_ref())
    }

    pub(crate) fn remove(&mut self, handle: u64) -> Option<T> {
        self.slot(handle)?;
        let index = (handle & 0xffff_ffff) as usize;
        let slot = &mut self.slots[index];
        let value = slot.value.take();
        slot.generation = slot.generation.wrapping_add(1).max(1);
        self.free.push(index as u32);
        self.live -= 1;
        value
    }

    pub(crate) fn len(&self) -> usize {
        self.live
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.value.as_ref())
    }

    /// Live values from slot `first` on, with their slot index (for paging: a slot keeps its
    /// place while others come and go).
    pub(crate) fn values_from(&self, first: usize) -> impl Iterator<Item = (usize, &T)> {
        self.slots
            .iter()
            .enumerate()
            .skip(first)
            .filter_map(|(i, s)| s.value.as_ref().map(|v| (i, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_and_forged_handles_miss() {
        let mut t = HandleTable::new(2);
        let a = t.insert("a").unwrap();
        let b = t.insert("b").unwrap();
        assert!(t.insert("c").is_none(), "limit");
        assert_eq!(t.get(a), Some(&"a"));
        assert_eq!(t.remove(a), Some("a"));
        assert_eq!(t.get(a), None, "stale");
        let c = t.insert("c").unwrap();
        assert_ne!(a, c, "slot reused with a new generation");
        assert_eq!(t.get(a), None);
        assert_eq!(t.get(0), None);
        assert_eq!(t.get(u64::MAX), None);
        assert_eq!(t.get(b ^ (1 << 40)), None, "forged generation");
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn handles_of_an_earlier_table_are_kept_and_checked() {
        let mut t = HandleTable::new(8);
        let h = 5u64 << 32 | 3;
        t.insert_at(h, "resumed").unwrap();
        assert_eq!(t.get(h), Some(&"resumed"));
        assert_eq!(t.insert_at(h, "again"), Err("given twice"));
        assert_eq!(t.insert_at(3, "gen0"), Err("generation 0 is never a handle"));
        assert_eq!(t.insert_at(1 << 32 | 8, "far"), Err("beyond the daemon's limit"));
        // The skipped slots are free, and a fresh insert never lands on the kept one.
        let fresh: Vec<u64> = (0..7)
            .map(|i| t.insert(i.to_string().leak() as &str).unwrap())
            .collect();
        assert!(!fresh.contains(&h));
        assert_eq!(t.len(), 8);
        assert!(t.insert("full").is_none());
    }
}
