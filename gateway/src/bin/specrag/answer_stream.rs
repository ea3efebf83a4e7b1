//! `specrag query`'s answer on stdout. The pipeline's pieces (final text, drafts, withdrawn
//! drafts, a replacement of the text so far) are applied to a mirror of the answer, as an HTTP
//! client applies the stream's events, so the mirror always holds what stands.
//!
//! Where stdout is a terminal the mirror is drawn as it changes: drafts dimmed after the final
//! text, and what was withdrawn erased by moving the cursor back to where the old and the new
//! text part and clearing the screen from there. Anywhere else (a file, a pipe) nothing can be
//! taken back once written, so the answer is written once, when it is final: a redirected
//! answer holds only the answer, and no escape code.

use gateway::pipeline::Piece;
use std::io::{self, IsTerminal as _, Write};

/// Where the answer is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// A terminal `columns` wide that takes ANSI cursor moves: the answer is drawn as it
    /// streams.
    Terminal { columns: usize },
    /// A file or a pipe: the final answer, once.
    Plain,
}

impl Output {
    /// What stdout is: a terminal (not `TERM=dumb`) whose width is known, else plain.
    pub fn stdout() -> Self {
        let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
        match stdout_columns() {
            Some(columns) if io::stdout().is_terminal() && !dumb => Self::Terminal { columns },
            _ => Self::Plain,
        }
    }
}

/// The width of the terminal on stdout, if it is one.
#[cfg(unix)]
fn stdout_columns() -> Option<usize> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` through the pointer, which is valid and
    // exclusive for the call; on a descriptor that is no terminal it fails and writes nothing.
    let r = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &raw mut ws) };
    (r == 0 && ws.ws_col > 0).then_some(usize::from(ws.ws_col))
}

#[cfg(not(unix))]
fn stdout_columns() -> Option<usize> {
    None
}

/// Dim, and back to normal: how drafts (not final yet) are drawn.
const DIM: &str = "\x1b[2m";
const NORMAL: &str = "\x1b[0m";

/// An answer being printed (see the module documentation).
pub struct AnswerPrinter<W: Write> {
    out: W,
    output: Output,
    /// The final text so far.
    text: String,
    /// Draft pieces after it, not final yet.
    drafts: Vec<String>,
    /// On a terminal: what is drawn, as display text (final, then drafts).
    drawn: (String, String),
}

impl<W: Write> AnswerPrinter<W> {
    pub fn new(out: W, output: Output) -> Self {
        Self {
            out,
            output,
            text: String::new(),
            drafts: Vec::new(),
            drawn: (String::new(), String::new()),
        }
    }

    /// Applies one piece of the stream, and on a terminal draws the change.
    pub fn apply(&mut self, piece: Piece<'_>) -> io::Result<()> {
        match piece {
            Piece::Token(t) | Piece::Commit(t) => {
                self.drafts.clear();
                self.text.push_str(t);
            }
            Piece::Draft(t) => self.drafts.push(t.to_string()),
            Piece::Retract(n) => {
                let keep = self.drafts.len().saturating_sub(n);
                self.drafts.truncate(keep);
            }
            Piece::Replace(t) => {
                self.drafts.clear();
                t.clone_into(&mut self.text);
            }
        }
        self.draw()
    }

    /// The final text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Ends the answer: drafts left are dropped, the final text is written (plain) or left
    /// drawn (terminal), then a newline.
    pub fn finish(mut self) -> io::Result<W> {
        self.drafts.clear();
        match self.output {
            Output::Terminal { .. } => self.draw()?,
            Output::Plain => self.out.write_all(self.text.as_bytes())?,
        }
        self.out.write_all(b"\n")?;
        self.out.flush()?;
        Ok(self.out)
    }

    /// On a terminal: takes the screen from what is drawn to the mirror, erasing back to the
    /// first character that differs (in text or in being a draft) and writing from there.
    fn draw(&mut self) -> io::Result<()> {
        let Output::Terminal { columns } = self.output else {
            return Ok(());
        };
        let drafts = self.drafts.concat();
        let (final_shown, all) = {
            let whole = format!("{}{drafts}", self.text);
            let f = display(&self.text, columns);
            let a = display(&whole, columns);
            (f.len(), a)
        };
        let (old_final, old_drafts) = &self.drawn;
        let old = format!("{old_final}{old_drafts}");
        let mut keep = common_prefix(&old, &all);
        if old_final.len() != final_shown {
            // A character drawn as a draft and now final (or the other way round) is redrawn.
            keep = keep.min(old_final.len().min(final_shown));
        }
        let mut w = Vec::new();
        if keep < old.len() {
            // Where the kept text fills its last row exactly, the cursor it leaves waits at the
            // row's end to wrap, which no cursor move reproduces: step back over the row's
            // last character and draw it again.
            while layout(&old[..keep], columns).1 >= columns {
                keep = old[..keep].char_indices().next_back().map_or(0, |(i, _)| i);
            }
            let end = layout(&old, columns);
            let (row, col) = layout(&old[..keep], columns);
            let up = end.0.saturating_sub(row);
            if up > 0 {
                write!(w, "\x1b[{up}A")?;
            }
            w.push(b'\r');
            if col > 0 {
                write!(w, "\x1b[{col}C")?;
            }
            w.extend_from_slice(b"\x1b[J");
        }
        let split = final_shown.max(keep);
        w.extend_from_slice(&all.as_bytes()[keep..split]);
        if split < all.len() {
            write!(w, "{DIM}{}{NORMAL}", &all[split..])?;
        }
        self.out.write_all(&w)?;
        self.out.flush()?;
        self.drawn = (
            all[..final_shown].to_string(),
            all[final_shown..].to_string(),
        );
        Ok(())
    }
}

/// The byte length of the longest common prefix of `a` and `b` that ends on a character
/// boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or_else(|| a.len().min(b.len()), |((i, _), _)| i)
}

/// Columns a character takes on a terminal: 2 for the wide East Asian ranges and emoji, 0 for
/// combining marks, 1 otherwise (an approximation of `wcwidth` good enough for model output;
/// a miscount misplaces an erase, never the text that stands).
fn width(c: char) -> usize {
    match u32::from(c) {
        0x0300..=0x036F | 0x200B..=0x200F | 0xFE00..=0xFE0F => 0,
        0x1100..=0x115F
        | 0x2E80..=0x303E
        | 0x3041..=0x33FF
        | 0x3400..=0x4DBF
        | 0x4E00..=0x9FFF
        | 0xA000..=0xA4CF
        | 0xAC00..=0xD7A3
        | 0xF900..=0xFAFF
        | 0xFE30..=0xFE4F
        | 0xFF00..=0xFF60
        | 0xFFE0..=0xFFE6
        | 0x1F300..=0x1F64F
        | 0x1F900..=0x1F9FF
        | 0x20000..=0x3FFFD => 2,
        _ => 1,
    }
}

/// `text` as it is drawn on a terminal `columns` wide: tabs expanded to spaces up to the next
/// stop of 8, other control characters (an escape sequence in a model's answer included)
/// drawn as spaces, so the drawn text is what [`layout`] measures and cannot move the cursor.
fn display(text: &str, columns: usize) -> String {
    let mut out = String::with_capacity(text.len());
    // The column in the current row, wrapping as `layout` does.
    let mut col = 0;
    let put = |out: &mut String, c: char, col: &mut usize| {
        let w = width(c);
        *col = if *col + w > columns { w } else { *col + w };
        out.push(c);
    };
    for c in text.chars() {
        match c {
            '\n' => {
                out.push('\n');
                col = 0;
            }
            '\t' => {
                for _ in 0..8 - col % 8 {
                    put(&mut out, ' ', &mut col);
                }
            }
            c if c.is_control() => put(&mut out, ' ', &mut col),
            c => put(&mut out, c, &mut col),
        }
    }
    out
}

/// Where the cursor stands after `drawn` (display text) is written from column 0 of a terminal
/// `columns` wide: (row, column), rows counted from the first. Column `columns` is a full row
/// whose next character goes to the next row (a terminal's deferred wrap).
fn layout(drawn: &str, columns: usize) -> (usize, usize) {
    let (mut row, mut col) = (0, 0);
    for c in drawn.chars() {
        if c == '\n' {
            (row, col) = (row + 1, 0);
            continue;
        }
        let w = width(c);
        if col + w > columns {
            (row, col) = (row + 1, 0);
        }
        col += w;
    }
    (row, col)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Piece::{Commit, Draft, Replace, Retract, Token};

    /// A guard escalation that withdraws shown text, then a verified stretch whose drafts are
    /// partly withdrawn: what stands is "The dog ran far away.".
    fn withdrawing_stream() -> Vec<Piece<'static>> {
        vec![
            Token("The cat"),
            Token(" sat on"),
            Replace("The dog"),
            Token(" ran"),
            Draft(" fast"),
            Draft(" home"),
            Retract(2),
            Commit(" far"),
            Draft(" aw"),
            Commit(" away."),
        ]
    }

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// What the printer writes for `pieces`, and the text it holds at the end.
    fn print(output: Output, pieces: &[Piece<'_>]) -> io::Result<(Vec<u8>, String)> {
        let mut p = AnswerPrinter::new(Vec::new(), output);
        for &piece in pieces {
            p.apply(piece)?;
        }
        let text = p.text().to_string();
        Ok((p.finish()?, text))
    }

    #[test]
    fn a_redirected_answer_holds_only_what_stands_and_no_escape_code() -> TestResult {
        // Issue 88: the withdrawn "The cat sat on" was printed, then the replacement, and
        // drafts went to stderr dimmed whatever stderr was.
        let pieces = withdrawing_stream();
        let mut p = AnswerPrinter::new(Vec::new(), Output::Plain);
        for &piece in &pieces[..3] {
            p.apply(piece)?;
        }
        assert!(
            p.out.is_empty(),
            "nothing is written before the answer is final"
        );
        let (out, text) = print(Output::Plain, &pieces)?;
        assert_eq!(text, "The dog ran far away.");
        assert_eq!(String::from_utf8(out)?, "The dog ran far away.\n");
        Ok(())
    }

    /// What a terminal `columns` wide shows after `bytes`: its rows, trailing blanks trimmed.
    /// It knows what the printer writes: text, `\r`, `\n` (as a tty writes it, back to column
    /// 0), cursor up (`A`), forward (`C`), clear to the end of the screen (`J`) and styles
    /// (`m`, ignored), with deferred wrap.
    fn screen(bytes: &[u8], columns: usize) -> Vec<String> {
        let text = String::from_utf8_lossy(bytes);
        let mut rows: Vec<Vec<char>> = vec![Vec::new()];
        let (mut r, mut c) = (0usize, 0usize);
        let mut chars = text.chars().peekable();
        while let Some(ch) = chars.next() {
            match ch {
                '\x1b' => {
                    assert_eq!(chars.next(), Some('['));
                    let mut n = String::new();
                    while let Some(d) = chars.next_if(char::is_ascii_digit) {
                        n.push(d);
                    }
                    let n: usize = n.parse().unwrap_or(1);
                    match chars.next() {
                        // Up leaves a full row's deferred wrap, as terminals do.
                        Some('A') => (r, c) = (r.saturating_sub(n), c.min(columns - 1)),
                        Some('C') => c = (c + n).min(columns - 1),
                        Some('J') => {
                            rows.truncate(r + 1);
                            if let Some(row) = rows.get_mut(r) {
                                row.truncate(c);
                            }
                        }
                        Some('m') => {}
                        other => panic!("unexpected escape {other:?}"),
                    }
                }
                '\r' => c = 0,
                '\n' => (r, c) = (r + 1, 0),
                ch => {
                    let w = width(ch);
                    if c + w > columns {
                        (r, c) = (r + 1, 0);
                    }
                    while rows.len() <= r {
                        rows.push(Vec::new());
                    }
                    let row = &mut rows[r];
                    if row.len() < c + 1 {
                        row.resize(c + 1, ' ');
                    }
                    row[c] = ch;
                    c += w;
                }
            }
            while rows.len() <= r {
                rows.push(Vec::new());
            }
        }
        rows.iter()
            .map(|row| row.iter().collect::<String>().trim_end().to_string())
            .collect()
    }

    #[test]
    fn on_a_terminal_what_was_withdrawn_is_erased_and_the_answer_stands_alone() -> TestResult {
        for columns in [5, 8, 80] {
            let (out, text) = print(Output::Terminal { columns }, &withdrawing_stream())?;
            let alone = format!("{text}\n");
            assert_eq!(
                screen(&out, columns),
                screen(alone.as_bytes(), columns),
                "{columns} columns: {:?}",
                String::from_utf8_lossy(&out)
            );
            assert!(
                out.windows(3).any(|w| w == b"\x1b[J"),
                "something was erased"
            );
        }
        Ok(())
    }

    #[test]
    fn a_terminal_erases_across_lines_and_wide_characters() -> TestResult {
        let pieces = [
            Token("line one\nline two is long"),
            Draft("\n漢字 draft"),
            Retract(1),
            Replace("line one\nline 2"),
            Token("\n\tdone 😀"),
        ];
        for columns in [4, 7, 30] {
            let (out, text) = print(Output::Terminal { columns }, &pieces)?;
            assert_eq!(text, "line one\nline 2\n\tdone 😀");
            let alone = format!("{}\n", display(&text, columns));
            assert_eq!(screen(&out, columns), screen(alone.as_bytes(), columns));
        }
        Ok(())
    }

    #[test]
    fn any_stream_leaves_a_terminal_showing_its_answer_alone() -> TestResult {
        use rand::{Rng as _, SeedableRng as _};
        let words = ["a", "bc", "def ", "\n", " 字", "ghij", "\t", "é", "klmno "];
        for seed in 0..300 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let columns = rng.gen_range(1..12);
            let word = |rng: &mut rand::rngs::StdRng| {
                (0..rng.gen_range(1..4))
                    .map(|_| words[rng.gen_range(0..words.len())])
                    .collect::<String>()
            };
            let mut texts = Vec::new();
            let mut pieces = Vec::new();
            for _ in 0..rng.gen_range(1..20) {
                texts.push(word(&mut rng));
                pieces.push(rng.gen_range(0..5));
            }
            let stream: Vec<Piece<'_>> = pieces
                .iter()
                .zip(&texts)
                .map(|(&k, t)| match k {
                    0 => Token(t),
                    1 => Commit(t),
                    2 => Draft(t),
                    3 => Retract(t.len() % 3),
                    _ => Replace(
                        t.char_indices()
                            .nth(t.chars().count() / 2)
                            .map_or(t, |(i, _)| &t[..i]),
                    ),
                })
                .collect();
            let (out, text) = print(Output::Terminal { columns }, &stream)?;
            let alone = format!("{}\n", display(&text, columns));
            assert_eq!(
                screen(&out, columns),
                screen(alone.as_bytes(), columns),
                "seed {seed}, {columns} columns, {stream:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn escape_codes_in_an_answer_are_drawn_as_spaces() -> TestResult {
        let (out, _) = print(Output::Terminal { columns: 80 }, &[Token("a\x1b[2Jb")])?;
        assert_eq!(String::from_utf8(out)?, "a [2Jb\n");
        Ok(())
    }
}
