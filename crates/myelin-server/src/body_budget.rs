//! A data core's budget for request bodies being read: every body counts its bytes against it
//! as they arrive, before they are buffered, until the request is admitted (the in-flight
//! limit bounds admitted ones). Past the budget a request is refused at once (429), so many
//! large uploads at once cannot take more memory than the budget, however many connections
//! and h2 streams carry them.

use std::cell::Cell;
use std::rc::Rc;

/// The bytes of bodies one data core may hold while reading them.
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    held: Cell<usize>,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Rc<BodyBudget> {
        Rc::new(BodyBudget {
            limit,
            held: Cell::new(0),
        })
    }

    /// Bytes held by bodies now.
    pub fn held(&self) -> usize {
        self.held.get()
    }

    /// An empty reservation for one body.
    pub fn reservation(self: &Rc<Self>) -> Reservation {
        Reservation {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

/// One body's bytes in the budget, given back when it is dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Rc<BodyBudget>,
    bytes: usize,
}

impl Reservation {
    /// Takes `bytes` more; false (nothing taken) when the budget does not hold them.
    pub fn grow(&mut self, bytes: usize) -> bool {
        let held = self.budget.held.get();
        match held.checked_add(bytes) {
            Some(total) if total <= self.budget.limit => {
                self.budget.held.set(total);
                self.bytes += bytes;
                true
            }
            _ => false,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let held = self.budget.held.get();
        self.budget.held.set(held.saturating_sub(self.bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_share_the_budget_and_give_it_back() {
        let budget = BodyBudget::new(100);
        let mut first = budget.reservation();
        let mut second = budget.reservation();
        assert!(first.grow(60));
        assert!(!second.grow(41), "past the budget");
        assert_eq!(budget.held(), 60, "a refused growth takes nothing");
        assert!(second.grow(40));
        assert_eq!(budget.held(), 100);
        drop(first);
        assert_eq!(budget.held(), 40);
        assert!(second.grow(60));
        assert!(!second.grow(usize::MAX), "no overflow");
        drop(second);
        assert_eq!(budget.held(), 0);
    }
}
