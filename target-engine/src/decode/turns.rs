//! Whose turn it is at prefill work ([`super::batch::DecodeBatcher::take_turn`]): one thread
//! at a time, in an order the server chooses ([`PrefillOrder`]).

/// The order prefill turns go in. Measured with four clients on 2 cores
/// (docs/performance.md, *Against llama-server*): `FirstPrefillsFirst` lowers the median time
/// to first token and raises the 95th percentile at the same requests/min, so the default is
/// `Fifo`, the one with the better tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillOrder {
    /// First come, first served.
    #[default]
    Fifo,
    /// A request's first prefill goes before prefill work begun while decoding (the guard's
    /// second look, its escalation's full prefill), which a later first prefill may overtake
    /// at most [`MAX_OVERTAKEN`] times: a request waiting for its first token does not wait
    /// behind another's escalation.
    FirstPrefillsFirst,
}

impl PrefillOrder {
    /// Its name in flags.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fifo => "fifo",
            Self::FirstPrefillsFirst => "first",
        }
    }
}

impl std::str::FromStr for PrefillOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "fifo" => Ok(Self::Fifo),
            "first" => Ok(Self::FirstPrefillsFirst),
            other => Err(format!(
                "prefill order `{other}`: expected fifo (first come, first served) or first \
                 (first prefills before work begun while decoding)"
            )),
        }
    }
}

/// How many first prefills may go ahead of one waiting turn of later work.
pub const MAX_OVERTAKEN: u32 = 2;

/// What a turn is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnKind {
    /// A request's prefill before its first token.
    First,
    /// Prefill work begun while decoding (a second look, an escalation).
    Later,
}

#[derive(Debug)]
struct Waiting {
    ticket: u64,
    kind: TurnKind,
    overtaken: u32,
}

/// The turns: who holds one, and who waits, in arrival order.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    next: u64,
    holder: Option<u64>,
    waiting: Vec<Waiting>,
}

impl Turns {
    /// A ticket for a turn of `kind`, waiting.
    pub(crate) fn enqueue(&mut self, kind: TurnKind) -> u64 {
        let ticket = self.next;
        self.next += 1;
        self.waiting.push(Waiting {
            ticket,
            kind,
            overtaken: 0,
        });
        ticket
    }

    /// Gives `ticket` the turn if nobody holds one and it is next in `order`; true once it
    /// holds it.
    pub(crate) fn try_take(&mut self, ticket: u64, order: PrefillOrder) -> bool {
        if self.holder.is_some() || self.next_in_line(order) != Some(ticket) {
            return false;
        }
        let at = self.waiting.iter().position(|w| w.ticket == ticket);
        let Some(at) = at else { return false };
        let taken = self.waiting.remove(at);
        if taken.kind == TurnKind::First {
            // Later work it went ahead of was overtaken once more.
            for w in self.waiting.iter_mut().take(at) {
                if w.kind == TurnKind::Later {
                    w.overtaken += 1;
                }
            }
        }
        self.holder = Some(ticket);
        true
    }

    /// The ticket whose turn comes next.
    fn next_in_line(&self, order: PrefillOrder) -> Option<u64> {
        let oldest = self.waiting.first()?;
        if order == PrefillOrder::Fifo || oldest.kind == TurnKind::First {
            return Some(oldest.ticket);
        }
        // The oldest waits for later work: a first prefill behind it goes first unless some
        // later work ahead of that first prefill was overtaken enough.
        let first = self.waiting.iter().position(|w| w.kind == TurnKind::First);
        match first {
            Some(i)
                if self.waiting[..i]
                    .iter()
                    .all(|w| w.overtaken < MAX_OVERTAKEN) =>
            {
                Some(self.waiting[i].ticket)
            }
            _ => Some(oldest.ticket),
        }
    }

    /// Forgets a ticket given up while waiting.
    pub(crate) fn drop_ticket(&mut self, ticket: u64) {
        self.waiting.retain(|w| w.ticket != ticket);
    }

    /// The holder gives the turn up.
    pub(crate) fn release(&mut self) {
        self.holder = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Grants in order: each step, whoever may take the turn takes it and gives it up.
    fn grants(queue: &[TurnKind], order: PrefillOrder) -> Vec<u64> {
        let mut t = Turns::default();
        let tickets: Vec<u64> = queue.iter().map(|&k| t.enqueue(k)).collect();
        let mut out = Vec::new();
        while out.len() < tickets.len() {
            let go = tickets
                .iter()
                .copied()
                .find(|&k| !out.contains(&k) && t.try_take(k, order))
                .expect("someone may go");
            out.push(go);
            t.release();
        }
        out
    }

    #[test]
    fn first_prefills_overtake_later_work_a_bounded_number_of_times() {
        use TurnKind::{First as F, Later as L};
        assert_eq!(
            grants(&[L, F, F, F, L, F], PrefillOrder::Fifo),
            [0, 1, 2, 3, 4, 5]
        );
        // The first later turn lets two first prefills go ahead, then goes.
        assert_eq!(
            grants(&[L, F, F, F, L, F], PrefillOrder::FirstPrefillsFirst),
            [1, 2, 0, 3, 5, 4]
        );
        assert_eq!(grants(&[F, L], PrefillOrder::FirstPrefillsFirst), [0, 1]);
        let mut t = Turns::default();
        let (a, b) = (t.enqueue(F), t.enqueue(F));
        assert!(
            !t.try_take(b, PrefillOrder::FirstPrefillsFirst),
            "not its turn yet"
        );
        t.drop_ticket(a);
        assert!(t.try_take(b, PrefillOrder::FirstPrefillsFirst));
        assert!(!t.try_take(b, PrefillOrder::Fifo), "held");
        assert_eq!("fifo".parse(), Ok(PrefillOrder::Fifo));
        assert!("lifo"
            .parse::<PrefillOrder>()
            .expect_err("no such order")
            .contains("fifo"));
    }
}
