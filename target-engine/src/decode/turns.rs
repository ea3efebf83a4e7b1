//! Whose turn it is at prefill work ([`super::batch::DecodeBatcher::take_turn`]): one thread
//! at a time, in an order the server chooses ([`PrefillOrder`]).

/// The order prefill turns go in. Measured with four clients on 2 cores
/// (docs/performance.md, *Against llama-server*): against `Fifo`, `FirstPrefillsFirst` and
/// `ShortFirst` cut the median time to first token by a quarter to a third at the same 95th
/// percentile and requests/min; with an escalation's full prefill in pieces (the server's
/// default), `FirstPrefillsFirst` had a lower median than `ShortFirst` at the same tail. It
/// is the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillOrder {
    /// First come, first served.
    Fifo,
    /// A request's first prefill goes before prefill work begun while decoding (the guard's
    /// second look, its escalation's full prefill), which a later first prefill may overtake
    /// at most [`MAX_OVERTAKEN`] times: a request waiting for its first token does not wait
    /// behind another's escalation. A look at a request's first token goes as its first
    /// prefill did ([`TurnKind::FirstLook`]).
    #[default]
    FirstPrefillsFirst,
    /// Short prefill work first: a request's first prefill and the guard's second looks go
    /// before an escalation's full prefill, which they may overtake at most
    /// [`MAX_OVERTAKEN`] times: as `FirstPrefillsFirst`, but a request whose first token was
    /// doubted does not wait behind escalations for its look.
    ShortFirst,
}

impl PrefillOrder {
    /// Its name in flags.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fifo => "fifo",
            Self::FirstPrefillsFirst => "first",
            Self::ShortFirst => "short-first",
        }
    }

    /// Whether a turn of `kind` goes before waiting turns that are not.
    fn urgent(self, kind: TurnKind) -> bool {
        match self {
            Self::Fifo => false,
            Self::FirstPrefillsFirst => matches!(kind, TurnKind::First | TurnKind::FirstLook),
            Self::ShortFirst => kind != TurnKind::Escalation,
        }
    }
}

impl std::str::FromStr for PrefillOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "fifo" => Ok(Self::Fifo),
            "first" => Ok(Self::FirstPrefillsFirst),
            "short-first" => Ok(Self::ShortFirst),
            other => Err(format!(
                "prefill order `{other}`: expected fifo (first come, first served), first \
                 (first prefills before the guard's looks and escalations) or short-first \
                 (first prefills and the guard's looks before its escalations)"
            )),
        }
    }
}

/// How many turns the order puts first may go ahead of one waiting turn it does not.
pub const MAX_OVERTAKEN: u32 = 2;

/// What a turn is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnKind {
    /// A request's prefill before its first token.
    First,
    /// The guard's second look: a few more chunk tokens recomputed.
    Look,
    /// The guard's second look at a request's first token: prefill work before its first
    /// token, as its first prefill was, so it goes as a first prefill does, in line where
    /// that prefill stood ([`super::batch::in_first_token_turn`]).
    FirstLook,
    /// An escalation's full prefill (or one piece of it).
    Escalation,
}

impl TurnKind {
    /// Its name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::First => "first",
            Self::Look | Self::FirstLook => "look",
            Self::Escalation => "escalation",
        }
    }
}

/// What the turns of one piece of work taken in several turns (an escalation's pieces)
/// carry from one to the next: how often they were overtaken, and the place in line of the
/// first, which the later ones keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkTurns {
    /// Turns that went ahead of its turns so far.
    pub overtaken: u32,
    /// The ticket of its first turn; none before it had one.
    since: Option<u64>,
}

#[derive(Debug)]
struct Waiting {
    ticket: u64,
    kind: TurnKind,
    overtaken: u32,
    /// Its place in line: its own ticket, or its work's first.
    since: u64,
}

/// The turns: who holds one, and who waits, in arrival order.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    next: u64,
    holder: Option<u64>,
    waiting: Vec<Waiting>,
}

impl Turns {
    /// A ticket for a turn of `kind`, waiting: in line where the earlier turns of the same
    /// `work` stood (at the end for new work), counted as overtaken as often as they were.
    pub(crate) fn enqueue(&mut self, kind: TurnKind, work: WorkTurns) -> u64 {
        let ticket = self.next;
        self.next += 1;
        let since = work.since.unwrap_or(ticket);
        let at = self
            .waiting
            .iter()
            .position(|w| w.since > since)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(
            at,
            Waiting {
                ticket,
                kind,
                overtaken: work.overtaken,
                since,
            },
        );
        ticket
    }

    /// Gives `ticket` the turn if nobody holds one and it is next in `order`; once it holds
    /// it, what its work's next turn carries.
    pub(crate) fn try_take(&mut self, ticket: u64, order: PrefillOrder) -> Option<WorkTurns> {
        if self.holder.is_some() || self.next_in_line(order) != Some(ticket) {
            return None;
        }
        let at = self.waiting.iter().position(|w| w.ticket == ticket)?;
        let taken = self.waiting.remove(at);
        if order.urgent(taken.kind) {
            // Work it went ahead of was overtaken once more.
            for w in self.waiting.iter_mut().take(at) {
                if !order.urgent(w.kind) {
                    w.overtaken += 1;
                }
            }
        }
        self.holder = Some(ticket);
        Some(WorkTurns {
            overtaken: taken.overtaken,
            since: Some(taken.since),
        })
    }

    /// The ticket whose turn comes next.
    fn next_in_line(&self, order: PrefillOrder) -> Option<u64> {
        let oldest = self.waiting.first()?;
        if order == PrefillOrder::Fifo || order.urgent(oldest.kind) {
            return Some(oldest.ticket);
        }
        // The oldest waits for work the order does not put first: the first urgent turn
        // behind it goes first unless some turn ahead of it was overtaken enough.
        let urgent = self.waiting.iter().position(|w| order.urgent(w.kind));
        match urgent {
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
        let tickets: Vec<u64> = queue
            .iter()
            .map(|&k| t.enqueue(k, WorkTurns::default()))
            .collect();
        let mut out = Vec::new();
        while out.len() < tickets.len() {
            let go = tickets
                .iter()
                .copied()
                .find(|&k| !out.contains(&k) && t.try_take(k, order).is_some())
                .expect("someone may go");
            out.push(go);
            t.release();
        }
        out
    }

    #[test]
    fn first_prefills_overtake_later_work_a_bounded_number_of_times() {
        use TurnKind::{Escalation as L, First as F};
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
        // `short-first`: the same, where no look waits.
        assert_eq!(
            grants(&[L, F, F, F, L, F], PrefillOrder::ShortFirst),
            [1, 2, 0, 3, 5, 4]
        );
        let mut t = Turns::default();
        let new = WorkTurns::default();
        let (a, b) = (t.enqueue(F, new), t.enqueue(F, new));
        assert_eq!(
            t.try_take(b, PrefillOrder::FirstPrefillsFirst),
            None,
            "not its turn yet"
        );
        t.drop_ticket(a);
        assert!(t.try_take(b, PrefillOrder::FirstPrefillsFirst).is_some());
        assert_eq!(t.try_take(b, PrefillOrder::Fifo), None, "held");
        assert_eq!("fifo".parse(), Ok(PrefillOrder::Fifo));
        assert_eq!("short-first".parse(), Ok(PrefillOrder::ShortFirst));
        assert!("lifo"
            .parse::<PrefillOrder>()
            .expect_err("no such order")
            .contains("fifo"));
    }

    #[test]
    fn a_look_waits_behind_no_escalation_only_under_short_first() {
        use TurnKind::{Escalation as L, First as F, Look as K};
        // A second look (K) ahead of first prefills: `first` lets two go
        // ahead of it, as of an escalation; `short-first` keeps it in its place, and puts it
        // ahead of escalations as it does first prefills.
        assert_eq!(
            grants(&[K, F, F, F], PrefillOrder::FirstPrefillsFirst),
            [1, 2, 0, 3]
        );
        assert_eq!(
            grants(&[K, F, F, F], PrefillOrder::ShortFirst),
            [0, 1, 2, 3]
        );
        assert_eq!(
            grants(&[L, K, F, L, K], PrefillOrder::ShortFirst),
            [1, 2, 0, 4, 3]
        );
        assert_eq!(
            grants(&[L, K, F, L, K], PrefillOrder::FirstPrefillsFirst),
            [2, 0, 1, 3, 4]
        );
        assert_eq!(grants(&[L, K, F], PrefillOrder::Fifo), [0, 1, 2]);
    }

    #[test]
    fn a_look_at_the_first_token_goes_where_the_first_prefill_stood() {
        use TurnKind::{Escalation as L, First as F, FirstLook as A, Look as K};
        let new = WorkTurns::default();
        for order in [
            PrefillOrder::Fifo,
            PrefillOrder::FirstPrefillsFirst,
            PrefillOrder::ShortFirst,
        ] {
            let mut t = Turns::default();
            // A request's first prefill; then two more requests, and an escalation, arrive.
            let first = t.enqueue(F, new);
            let work = t.try_take(first, order).expect("alone");
            t.release();
            let (b, later) = (t.enqueue(F, new), t.enqueue(L, new));
            // Its look at the first token goes before all of them, in every order.
            let look = t.enqueue(A, work);
            assert_eq!(t.try_take(b, order), None, "{order:?}");
            assert_eq!(t.try_take(later, order), None, "{order:?}");
            assert!(t.try_take(look, order).is_some(), "{order:?}");
        }
        // A look at a later token waits behind the first prefill under `first`.
        let mut t = Turns::default();
        let order = PrefillOrder::FirstPrefillsFirst;
        let first = t.enqueue(F, new);
        t.try_take(first, order).expect("alone");
        t.release();
        let b = t.enqueue(F, new);
        let look = t.enqueue(K, new);
        assert_eq!(t.try_take(look, order), None);
        assert!(t.try_take(b, order).is_some());
        // Under `first` it goes ahead of an escalation begun before the request, as first
        // prefills do (twice at most).
        let mut t = Turns::default();
        let old = t.enqueue(L, new);
        let first = t.enqueue(F, new);
        let work = t
            .try_take(first, order)
            .expect("a first prefill goes first");
        t.release();
        let look = t.enqueue(A, work);
        assert_eq!(t.try_take(old, order), None);
        assert!(t.try_take(look, order).is_some());
        t.release();
        assert!(t.try_take(old, order).is_some(), "overtaken twice");
        assert_eq!(TurnKind::FirstLook.name(), "look");
    }

    #[test]
    fn the_turns_of_one_work_are_overtaken_at_most_twice_in_all_and_keep_its_place() {
        use TurnKind::{Escalation as L, First as F};
        let order = PrefillOrder::ShortFirst;
        let new = WorkTurns::default();
        let mut t = Turns::default();
        // An escalation's first piece waits while two first prefills arrive: both go first.
        let piece = t.enqueue(L, new);
        let (f1, f2) = (t.enqueue(F, new), t.enqueue(F, new));
        assert!(t.try_take(f1, order).is_some());
        t.release();
        assert!(t.try_take(f2, order).is_some());
        t.release();
        let work = t.try_take(piece, order).expect("its turn");
        assert_eq!(work.overtaken, 2);
        t.release();
        // Another escalation starts; then the first one's next piece: it carries the count,
        // so a first prefill arriving behind it waits, and it keeps its place ahead of the
        // escalation begun after it.
        let other = t.enqueue(L, new);
        let next = t.enqueue(L, work);
        let f3 = t.enqueue(F, new);
        assert_eq!(t.try_take(f3, order), None, "the work was overtaken enough");
        assert_eq!(t.try_take(other, order), None, "begun later");
        assert!(t.try_take(next, order).is_some());
        t.release();
        // The other escalation was overtaken by nobody yet: the first prefill goes first.
        assert_eq!(t.try_take(other, order), None);
        assert!(t.try_take(f3, order).is_some());
        t.release();
        assert!(t.try_take(other, order).is_some());
    }
}
