//! An answer's text on its way out, whatever decoding produced its tokens: one place where
//! stop strings cut the answer and text is held back while it may still become a stop string
//! or ends inside a UTF-8 character, for plain decoding, speculative decoding, verification
//! (drafted, committed and withdrawn tokens) and the fidelity guard's move to the full cache
//! (tokens already shown, some of them withdrawn).
//!
//! [`TextStream`] keeps the tokens (final ones, then drafts not yet final) and a mirror of what
//! its consumer has been shown: final text, then draft pieces. After every change it works out
//! what the consumer should see and sends the fewest [`Shown`] events that take the mirror
//! there. A consumer that applies them (final text appends and clears the drafts, a draft
//! appends a piece, a retraction drops the last pieces, a replacement sets the final text and
//! clears the drafts) holds, once the stream is finished, exactly [`TextStream::text`].

use crate::tokenizer::Tokenizer;

/// What a consumer of a [`TextStream`] is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown<'a> {
    /// Final text, appended after the final text shown so far (drafts shown are cleared).
    Final(&'a str),
    /// Text of drafted tokens, not final yet: one more piece after those shown.
    Draft(&'a str),
    /// The last `n` draft pieces shown are withdrawn.
    Retract(usize),
    /// The final text shown so far becomes this (drafts shown are cleared): text that was
    /// shown as final has been withdrawn.
    Replace(&'a str),
}

/// Whether generation goes on after an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Go,
    /// The final text reached a stop string: the answer ends before it.
    Stop,
    /// The consumer said stop.
    Cancel,
}

/// The text of an answer as it is shown (see the module documentation).
#[derive(Debug)]
pub struct TextStream<'t> {
    tok: &'t Tokenizer,
    stop: Vec<String>,
    ids: Vec<u32>,
    drafts: Vec<u32>,
    /// The final text the consumer holds.
    shown: String,
    /// The draft pieces the consumer holds.
    pieces: Vec<String>,
    stopped: bool,
    cancelled: bool,
}

impl<'t> TextStream<'t> {
    /// A stream with nothing shown; `stop` strings end the answer (empty ones are ignored).
    pub fn new(tok: &'t Tokenizer, stop: &[String]) -> Self {
        let stop: Vec<String> = stop.iter().filter(|s| !s.is_empty()).cloned().collect();
        Self {
            tok,
            stop,
            ids: Vec::new(),
            drafts: Vec::new(),
            shown: String::new(),
            pieces: Vec::new(),
            stopped: false,
            cancelled: false,
        }
    }

    /// A stream that goes on from `ids`, of which the consumer has been shown `shown` as final
    /// text (a prefix of their text, e.g. by another stream that has stopped).
    pub fn resume(tok: &'t Tokenizer, stop: &[String], ids: &[u32], shown: &str) -> Self {
        let mut s = Self::new(tok, stop);
        s.ids = ids.to_vec();
        s.shown = shown.to_string();
        s
    }

    /// Final tokens, after those so far (the drafts are resolved: they are dropped, and a
    /// caller whose drafts were accepted passes them here).
    pub fn commit(&mut self, ids: &[u32], out: &mut dyn FnMut(Shown<'_>) -> bool) -> Flow {
        if self.ended() {
            return self.flow();
        }
        self.drafts.clear();
        self.ids.extend_from_slice(ids);
        self.sync(false, out)
    }

    /// A drafted token, not final yet.
    pub fn draft(&mut self, id: u32, out: &mut dyn FnMut(Shown<'_>) -> bool) -> Flow {
        if self.ended() {
            return self.flow();
        }
        self.drafts.push(id);
        self.sync(false, out)
    }

    /// The last `n` drafted tokens are withdrawn.
    pub fn retract(&mut self, n: usize, out: &mut dyn FnMut(Shown<'_>) -> bool) -> Flow {
        if self.ended() {
            return self.flow();
        }
        let keep = self.drafts.len().saturating_sub(n);
        self.drafts.truncate(keep);
        self.sync(false, out)
    }

    /// Only the first `n` final tokens stand (the rest, and the drafts, are withdrawn).
    pub fn keep(&mut self, n: usize, out: &mut dyn FnMut(Shown<'_>) -> bool) -> Flow {
        if self.ended() {
            return self.flow();
        }
        self.ids.truncate(n);
        self.drafts.clear();
        self.sync(false, out)
    }

    /// Generation has ended: drafts are dropped and the final text held back is shown.
    pub fn finish(&mut self, out: &mut dyn FnMut(Shown<'_>) -> bool) -> Flow {
        if self.cancelled {
            return Flow::Cancel;
        }
        self.drafts.clear();
        self.sync(true, out)
    }

    /// The final tokens; when a stop string ended the answer, up to the one that completed it.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The answer's text: the final tokens' text, cut before a stop string.
    pub fn text(&self) -> String {
        let mut t = self.tok.decode(&self.ids, false);
        self.cut(&mut t);
        t
    }

    /// True once a stop string ended the answer.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The final text the consumer has been shown.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    fn ended(&self) -> bool {
        self.stopped || self.cancelled
    }

    fn flow(&self) -> Flow {
        if self.cancelled {
            Flow::Cancel
        } else if self.stopped {
            Flow::Stop
        } else {
            Flow::Go
        }
    }

    /// Cuts `text` before the first stop string in it; whether there was one.
    fn cut(&self, text: &mut String) -> bool {
        let at = self.stop.iter().filter_map(|s| text.find(s.as_str())).min();
        if let Some(at) = at {
            text.truncate(at);
        }
        at.is_some()
    }

    /// Whether `text` holds a stop string.
    fn has_stop(&self, text: &str) -> bool {
        self.stop.iter().any(|s| text.contains(s.as_str()))
    }

    /// Where the final text reached a stop string: the ids are cut after the token that
    /// completed it (the rest never happened), drafts dropped.
    fn check_stop(&mut self, text: &str) {
        if self.stopped || !self.has_stop(text) {
            return;
        }
        self.stopped = true;
        self.drafts.clear();
        let end = (1..=self.ids.len())
            .find(|&k| self.has_stop(&self.tok.decode(&self.ids[..k], false)))
            .unwrap_or(self.ids.len());
        self.ids.truncate(end);
    }

    /// Shows what the tokens say now: the final text (all of it at the end or after a stop
    /// string, else all but what may still change), then the drafts' text after it.
    fn sync(&mut self, end: bool, out: &mut dyn FnMut(Shown<'_>) -> bool) -> Flow {
        let mut text = self.tok.decode(&self.ids, false);
        self.check_stop(&text);
        self.cut(&mut text);
        let complete = end || self.stopped;
        let target = if complete {
            text.clone()
        } else {
            held(&text, &self.stop)
        };
        if target != self.shown {
            let ok = match target.strip_prefix(self.shown.as_str()) {
                Some(rest) => out(Shown::Final(rest)),
                None => out(Shown::Replace(&target)),
            };
            self.shown = target;
            self.pieces.clear();
            if !ok {
                self.cancelled = true;
                return Flow::Cancel;
            }
        }
        let draft = if complete || self.drafts.is_empty() {
            String::new()
        } else {
            let mut all: Vec<u32> = self.ids.clone();
            all.extend(&self.drafts);
            let mut all = self.tok.decode(&all, false);
            self.cut(&mut all);
            let all = held(&all, &[]);
            all.strip_prefix(self.shown.as_str())
                .map(str::to_string)
                .unwrap_or_default()
        };
        let mut joined: String = self.pieces.concat();
        let mut withdrawn = 0;
        while !draft.starts_with(joined.as_str()) {
            self.pieces.pop();
            withdrawn += 1;
            joined = self.pieces.concat();
        }
        if withdrawn > 0 && !out(Shown::Retract(withdrawn)) {
            self.cancelled = true;
            return Flow::Cancel;
        }
        let rest = &draft[joined.len()..];
        if !rest.is_empty() {
            let ok = out(Shown::Draft(rest));
            self.pieces.push(rest.to_string());
            if !ok {
                self.cancelled = true;
                return Flow::Cancel;
            }
        }
        self.flow()
    }
}

/// `text` without what may still change: a last character not complete yet (decoded as
/// U+FFFD) and the longest end that begins a stop string (it may still become one).
fn held(text: &str, stop: &[String]) -> String {
    let t = text.trim_end_matches('\u{FFFD}');
    let mut upto = t.len();
    for s in stop {
        if let Some(k) = (1..s.len())
            .rev()
            .find(|&k| s.is_char_boundary(k) && t.ends_with(&s[..k]))
        {
            upto = upto.min(t.len() - k);
        }
    }
    t[..upto].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::tiny as byte_tokenizer;

    /// A consumer that applies what it is shown, as the web page does.
    #[derive(Default, Debug)]
    struct Screen {
        text: String,
        pieces: Vec<String>,
        events: Vec<String>,
    }

    impl Screen {
        fn apply(&mut self, s: Shown<'_>) -> bool {
            self.events.push(format!("{s:?}"));
            match s {
                Shown::Final(t) => {
                    self.pieces.clear();
                    self.text.push_str(t);
                }
                Shown::Draft(t) => self.pieces.push(t.to_string()),
                Shown::Retract(n) => {
                    let keep = self.pieces.len().saturating_sub(n);
                    self.pieces.truncate(keep);
                }
                Shown::Replace(t) => {
                    self.pieces.clear();
                    self.text = t.to_string();
                }
            }
            assert!(!s_text(&s).contains('\u{FFFD}'), "{s:?}");
            true
        }
    }

    fn s_text<'a>(s: &Shown<'a>) -> &'a str {
        match s {
            Shown::Final(t) | Shown::Draft(t) | Shown::Replace(t) => t,
            Shown::Retract(_) => "",
        }
    }

    /// The tiny vocabulary's byte tokens: token `b` is byte `b`.
    fn ids(_: &Tokenizer, text: &[u8]) -> Vec<u32> {
        text.iter().map(|&b| u32::from(b)).collect()
    }

    #[test]
    fn a_character_split_across_tokens_is_shown_whole() {
        let tok = byte_tokenizer();
        let mut screen = Screen::default();
        let mut s = TextStream::new(&tok, &[]);
        for id in ids(&tok, "é 😀!".as_bytes()) {
            assert_eq!(s.commit(&[id], &mut |e| screen.apply(e)), Flow::Go);
        }
        s.finish(&mut |e| screen.apply(e));
        assert_eq!(screen.text, "é 😀!");
        assert_eq!(s.text(), "é 😀!");
    }

    #[test]
    fn a_stop_string_cuts_the_answer_and_its_tokens() {
        let tok = byte_tokenizer();
        let mut screen = Screen::default();
        let mut s = TextStream::new(&tok, &["\n".into(), "END".into()]);
        let all = ids(&tok, b"one\ntwo");
        let mut flow = Flow::Go;
        for id in &all {
            flow = s.commit(&[*id], &mut |e| screen.apply(e));
            if flow != Flow::Go {
                break;
            }
        }
        assert_eq!(flow, Flow::Stop);
        assert_eq!(screen.text, "one");
        assert_eq!(s.text(), "one");
        assert_eq!(
            s.ids().len(),
            4,
            "up to the token that completed the stop string"
        );
        // Committed in one go (a verification round), past the stop string.
        let mut screen = Screen::default();
        let mut s = TextStream::new(&tok, &["EN".into()]);
        assert_eq!(
            s.commit(&ids(&tok, b"abcENDxyz"), &mut |e| screen.apply(e)),
            Flow::Stop
        );
        assert_eq!((screen.text.as_str(), s.ids().len()), ("abc", 5));
        // Text that only looks like the start of a stop string is shown at the end.
        let mut screen = Screen::default();
        let mut s = TextStream::new(&tok, &["ENDS".into()]);
        s.commit(&ids(&tok, b"abEND"), &mut |e| screen.apply(e));
        assert_eq!(screen.text, "ab");
        s.finish(&mut |e| screen.apply(e));
        assert_eq!(screen.text, "abEND");
    }

    #[test]
    fn drafts_retractions_and_commits_leave_the_answer_on_screen() {
        let tok = byte_tokenizer();
        let mut screen = Screen::default();
        let mut s = TextStream::new(&tok, &["!".into()]);
        let mut out = |e: Shown<'_>| screen.apply(e);
        for id in ids(&tok, b"abc") {
            s.draft(id, &mut out);
        }
        s.retract(2, &mut out);
        s.commit(&ids(&tok, b"aX"), &mut out);
        // A draft past a stop string is not shown; a commit of it stops the answer.
        for id in ids(&tok, b"Y!Z") {
            s.draft(id, &mut out);
        }
        assert_eq!(s.commit(&ids(&tok, b"Y!Z"), &mut out), Flow::Stop);
        s.finish(&mut out);
        assert_eq!(screen.text, "aXY");
        assert!(screen.pieces.is_empty());
        assert!(
            !screen.events.iter().any(|e| e.contains('!')),
            "{:?}",
            screen.events
        );
    }

    #[test]
    fn withdrawn_final_text_is_replaced_and_the_rest_goes_on() {
        let tok = byte_tokenizer();
        let mut screen = Screen::default();
        let mut s = TextStream::new(&tok, &[]);
        let mut out = |e: Shown<'_>| screen.apply(e);
        s.commit(&ids(&tok, b"the cat"), &mut out);
        // The guard's move: another stream showed "the cat" of these ids; 4 of them stand.
        let mut r = TextStream::resume(&tok, &[], s.ids(), s.shown());
        r.keep(4, &mut out);
        r.commit(&ids(&tok, b"dog"), &mut out);
        r.finish(&mut out);
        assert_eq!(screen.text, "the dog");
        assert!(screen.events.iter().any(|e| e.starts_with("Replace")));
        // Nothing withdrawn and nothing new: what was held back still comes out at the end.
        let mut screen = Screen::default();
        let mut out = |e: Shown<'_>| screen.apply(e);
        let all = ids(&tok, "ok é".as_bytes());
        let mut s = TextStream::new(&tok, &[]);
        s.commit(&all[..all.len() - 1], &mut out);
        let mut r = TextStream::resume(&tok, &[], &all, s.shown());
        r.keep(all.len(), &mut out);
        r.finish(&mut out);
        assert_eq!(screen.text, "ok é");
        assert!(!screen.events.iter().any(|e| e.starts_with("Replace")));
    }

    #[test]
    fn a_consumer_that_says_stop_cancels() {
        let tok = byte_tokenizer();
        let mut s = TextStream::new(&tok, &[]);
        assert_eq!(s.commit(&ids(&tok, b"a"), &mut |_| false), Flow::Cancel);
        assert_eq!(s.commit(&ids(&tok, b"b"), &mut |_| true), Flow::Cancel);
        assert_eq!(s.finish(&mut |_| true), Flow::Cancel);
    }
}
