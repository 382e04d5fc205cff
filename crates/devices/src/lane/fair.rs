//! A lane's batch queue: each tenant's jobs in push order, tenants served by weight (start-time
//! fair queueing over predicted device time, see [`crate::Share`]).
//!
//! Owns the order among tenants only; what a job is and when the lane may start one (slice
//! depth, exclusivity) stay with the lane. Must not reorder one tenant's jobs: a queue's tasks
//! and a replay ahead of its queue's later tasks rely on that order.
//!
//! Each tenant has a *pass*: the lane time it was charged, divided by its weight. The next job
//! comes from the tenant with the lowest pass (the earliest to arrive among equals), and starting
//! it adds its charge / weight. A tenant whose jobs ran out and that comes back starts at the
//! pass of the job that started last (the lane's virtual time), so idling saves no credit and
//! costs none. Tenants are few (the sessions with work on one lane): a linear scan beats a heap
//! here, and one tenant costs what the plain FIFO did.

use std::collections::VecDeque;

/// Charges are scaled by this before the division by the weight, so that weights up to a
/// million still order jobs of a nanosecond.
const SCALE: u128 = 1 << 20;

/// Tenants kept with nothing queued, beyond which those are forgotten (their pass is the lane's
/// virtual time or near it anyway).
const IDLE_TENANTS_KEPT: usize = 16;

/// A batch queue shared by tenants by weight.
pub(super) struct FairQueue<T> {
    tenants: Vec<Tenant<T>>,
    /// The pass of the tenant whose job started last.
    virtual_time: u128,
    len: usize,
}

struct Tenant<T> {
    id: u64,
    weight: u32,
    pass: u128,
    items: VecDeque<T>,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            tenants: Vec::new(),
            virtual_time: 0,
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `item` to `tenant`'s jobs (its weight is updated to `weight`).
    pub(super) fn push_back(&mut self, tenant: u64, weight: u32, item: T) {
        self.tenant(tenant, weight).items.push_back(item);
        self.len += 1;
    }

    /// Puts `item` before `tenant`'s other jobs (a replay, or a sliced launch's rest).
    pub(super) fn push_front(&mut self, tenant: u64, weight: u32, item: T) {
        self.tenant(tenant, weight).items.push_front(item);
        self.len += 1;
    }

    /// The job [`FairQueue::pop_front`] would take.
    pub(super) fn front(&self) -> Option<&T> {
        self.next().and_then(|i| self.tenants[i].items.front())
    }

    /// Takes the next job: the front of the tenant with the lowest pass, which is charged
    /// `charge_ns(job)` nanoseconds for it.
    pub(super) fn pop_front(&mut self, charge_ns: impl FnOnce(&T) -> u64) -> Option<T> {
        let index = self.next()?;
        let tenant = &mut self.tenants[index];
        let item = tenant.items.pop_front()?;
        self.len -= 1;
        self.virtual_time = tenant.pass;
        let charge = u128::from(charge_ns(&item).max(1)) * SCALE / u128::from(tenant.weight.max(1));
        tenant.pass = tenant.pass.saturating_add(charge.max(1));
        Some(item)
    }

    /// Takes every job, tenant by tenant (to cancel them).
    pub(super) fn drain(&mut self) -> Vec<T> {
        self.len = 0;
        self.tenants.drain(..).flat_map(|t| t.items).collect()
    }

    /// Gives back the memory of a flood once the queue is empty: forgets idle tenants and
    /// shrinks each queue's room to `keep`.
    pub(super) fn shrink(&mut self, keep: usize) {
        if self.len == 0 {
            self.tenants.clear();
            self.tenants.shrink_to(IDLE_TENANTS_KEPT);
        }
        for tenant in &mut self.tenants {
            if tenant.items.capacity() > keep {
                tenant.items.shrink_to(keep);
            }
        }
    }

    /// The index of the tenant whose job goes next: the lowest pass among those with jobs.
    fn next(&self) -> Option<usize> {
        let mut best: Option<(usize, u128)> = None;
        for (index, tenant) in self.tenants.iter().enumerate() {
            if !tenant.items.is_empty() && best.is_none_or(|(_, pass)| tenant.pass < pass) {
                best = Some((index, tenant.pass));
            }
        }
        best.map(|(index, _)| index)
    }

    /// `id`'s entry, made (at the lane's virtual time) if need be; an idle tenant coming back is
    /// brought up to the virtual time.
    fn tenant(&mut self, id: u64, weight: u32) -> &mut Tenant<T> {
        let index = match self.tenants.iter().position(|t| t.id == id) {
            Some(index) => index,
            None => {
                if self.tenants.len() >= IDLE_TENANTS_KEPT {
                    self.tenants.retain(|t| !t.items.is_empty());
                }
                self.tenants.push(Tenant {
                    id,
                    weight,
                    pass: self.virtual_time,
                    items: VecDeque::new(),
                });
                self.tenants.len() - 1
            }
        };
        let virtual_time = self.virtual_time;
        let tenant = &mut self.tenants[index];
        if tenant.items.is_empty() {
            tenant.pass = tenant.pass.max(virtual_time);
        }
        tenant.weight = weight.max(1);
        tenant
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts `count` jobs, each charged `cost` (a job is `(tenant, sequence)`).
    fn start(queue: &mut FairQueue<(u64, u32)>, count: usize, cost: u64) -> Vec<(u64, u32)> {
        (0..count).filter_map(|_| queue.pop_front(|_| cost)).collect()
    }

    #[test]
    fn backlogged_tenants_share_by_weight_and_each_keeps_its_order() {
        let mut queue = FairQueue::default();
        for sequence in 0..100 {
            queue.push_back(1, 3, (1, sequence));
            queue.push_back(2, 1, (2, sequence));
        }
        let started = start(&mut queue, 80, 1_000);
        let first = started.iter().filter(|(tenant, _)| *tenant == 1).count();
        assert!(
            (59..=61).contains(&first),
            "weight 3 of 4 gets three quarters of 80: {started:?}"
        );
        for tenant in [1, 2] {
            let order: Vec<u32> = started.iter().filter(|(t, _)| *t == tenant).map(|(_, s)| *s).collect();
            assert!(
                order.windows(2).all(|w| w[0] + 1 == w[1]),
                "tenant {tenant} in order: {order:?}"
            );
        }
        // Equal weights alternate.
        let mut queue = FairQueue::default();
        for sequence in 0..10 {
            queue.push_back(5, 1, (5, sequence));
            queue.push_back(6, 1, (6, sequence));
        }
        let tenants: Vec<u64> = start(&mut queue, 6, 1_000).into_iter().map(|(t, _)| t).collect();
        assert_eq!(tenants, [5, 6, 5, 6, 5, 6]);
    }

    #[test]
    fn charges_are_device_time_not_job_counts() {
        // Tenant 1's jobs cost ten times tenant 2's: at equal weights tenant 2 starts ten jobs
        // for each of tenant 1's.
        let mut queue: FairQueue<(u64, u32)> = FairQueue::default();
        for sequence in 0..50 {
            queue.push_back(1, 1, (1, sequence));
            queue.push_back(2, 1, (2, sequence));
        }
        let mut started = Vec::new();
        for _ in 0..44 {
            started.push(
                queue
                    .pop_front(|&(tenant, _)| if tenant == 1 { 10_000 } else { 1_000 })
                    .unwrap(),
            );
        }
        let big = started.iter().filter(|(t, _)| *t == 1).count();
        assert_eq!(big, 4, "{started:?}");
    }

    #[test]
    fn an_idle_tenant_comes_back_without_credit_and_a_replay_goes_first() {
        let mut queue = FairQueue::default();
        for sequence in 0..20 {
            queue.push_back(1, 1, (1, sequence));
        }
        // Tenant 1 ran alone for a while; tenant 2 arrives and does not get the lane for the
        // next 10 jobs in a row (it starts level, so they alternate).
        let _ = start(&mut queue, 10, 1_000);
        for sequence in 0..10 {
            queue.push_back(2, 1, (2, sequence));
        }
        let tenants: Vec<u64> = start(&mut queue, 4, 1_000).into_iter().map(|(t, _)| t).collect();
        assert_eq!(tenants.iter().filter(|t| **t == 2).count(), 2, "{tenants:?}");
        // A job put back at the front of its tenant's queue is that tenant's next.
        queue.push_front(2, 1, (2, 99));
        let next_of_2 = std::iter::from_fn(|| queue.pop_front(|_| 1_000))
            .find(|(t, _)| *t == 2)
            .unwrap();
        assert_eq!(next_of_2, (2, 99));
        // 31 pushed, 15 started.
        let left = queue.drain();
        assert_eq!(left.len(), 16, "{left:?}");
        assert!(queue.is_empty() && queue.front().is_none());
    }
}
