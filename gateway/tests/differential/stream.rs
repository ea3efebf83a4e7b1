//! What a client shows of a streamed answer, applied event by event as the web page
//! (`/rag/query`) and an OpenAI client do, and the pieces that showed a U+FFFD the answer
//! does not have at that place.

use serde_json::Value;

/// A streamed answer as its client saw it.
#[derive(Debug, Default, Clone)]
pub struct Shown {
    /// The text shown once the stream ended (committed text only).
    pub text: String,
    /// The object the stream ended with: `/rag/query`'s `done` answer, or the OpenAI finish
    /// chunk with the usage chunk's `usage` added.
    pub last: Option<Value>,
    /// What went wrong in the stream itself (an `error` event, no end, unreadable data).
    pub errors: Vec<String>,
    /// Every piece of text the stream showed, with the byte offset where it was placed.
    pub pieces: Vec<(usize, String)>,
    /// The whole text shown after each piece (committed text and the drafts shown after
    /// it): what a client's screen held at each moment.
    pub views: Vec<String>,
}

impl Shown {
    /// Where the stream showed `stop` or anything after it: a piece that holds it, or a moment
    /// when the text shown held it (a stop string split across pieces shows only there). The
    /// first such moment of each kind.
    pub fn stop_leaks(&self, stop: &str) -> Vec<String> {
        let mut leaks = Vec::new();
        if let Some((at, piece)) = self.pieces.iter().find(|(_, p)| p.contains(stop)) {
            leaks.push(format!("piece {piece:?} at byte {at}"));
        }
        if let Some((i, view)) = self
            .views
            .iter()
            .enumerate()
            .find(|(_, v)| v.contains(stop))
        {
            leaks.push(format!("the text shown after piece {}: {view:?}", i + 1));
        }
        leaks
    }

    /// Pieces that showed U+FFFD where `answer` has no U+FFFD: a character split across
    /// tokens and shown before it was whole.
    pub fn replacement_chars(&self, answer: &str) -> Vec<String> {
        let mut bad = Vec::new();
        for (at, piece) in &self.pieces {
            for (i, _) in piece.match_indices('\u{FFFD}') {
                let place = at + i;
                let there = answer
                    .get(place..)
                    .is_some_and(|r| r.starts_with('\u{FFFD}'));
                if !there {
                    bad.push(format!("piece {piece:?} at byte {at}"));
                    break;
                }
            }
        }
        bad
    }
}

/// `(event, data)` of each server-sent event of `sse` that carries data.
fn events(sse: &str) -> Vec<(String, String)> {
    sse.split("\n\n")
        .filter_map(|block| {
            let mut event = "message".to_string();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event:") {
                    event = e.trim().to_string();
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            (!data.is_empty()).then_some((event, data))
        })
        .collect()
}

/// A `/rag/query` stream applied as `gateway/assets/web/index.html` applies it: `token` and
/// `commit` append to the committed text (and end the drafts), `draft` shows a piece after
/// it, `retract` withdraws the last `tokens` drafted pieces, `replace` makes its text the
/// committed text (and ends the drafts); drafts still shown at the end do not count.
pub fn rag(sse: &str) -> Shown {
    let mut s = Shown::default();
    let mut drafts: Vec<String> = Vec::new();
    for (event, data) in events(sse) {
        let v: Value = match serde_json::from_str(&data) {
            Ok(v) => v,
            Err(e) => {
                s.errors
                    .push(format!("unreadable `{event}` data {data:?}: {e}"));
                continue;
            }
        };
        let text = v["text"].as_str().unwrap_or("").to_string();
        match event.as_str() {
            "token" | "commit" => {
                drafts.clear();
                s.pieces.push((s.text.len(), text.clone()));
                s.text.push_str(&text);
            }
            "draft" => {
                let at = s.text.len() + drafts.iter().map(String::len).sum::<usize>();
                s.pieces.push((at, text.clone()));
                drafts.push(text);
            }
            "retract" => {
                let n = v["tokens"].as_u64().unwrap_or(0) as usize;
                drafts.truncate(drafts.len().saturating_sub(n));
            }
            "replace" => {
                drafts.clear();
                s.pieces.push((0, text.clone()));
                s.text = text;
            }
            "done" => s.last = Some(v),
            "error" => s.errors.push(format!("error event: {data}")),
            other => s.errors.push(format!("unknown event `{other}`: {data}")),
        }
        if matches!(event.as_str(), "token" | "commit" | "draft" | "replace") {
            s.views.push(format!("{}{}", s.text, drafts.concat()));
        }
    }
    if s.last.is_none() {
        s.errors
            .push("the stream ended without a `done` event".into());
    }
    s
}

/// An OpenAI stream as a client reads it: the chunks' `delta.content` concatenated, a chunk's
/// `specrag.replace` (the guard moved the answer to the full cache) first making the text so
/// far its text; the finish chunk (with the usage chunk's `usage`) is `last`.
pub fn openai(sse: &str) -> Shown {
    let mut s = Shown::default();
    let mut done = false;
    let mut usage = Value::Null;
    for (_, data) in events(sse) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = match serde_json::from_str(&data) {
            Ok(v) => v,
            Err(e) => {
                s.errors.push(format!("unreadable chunk {data:?}: {e}"));
                continue;
            }
        };
        if v.get("error").is_some() {
            s.errors.push(format!("error chunk: {data}"));
            continue;
        }
        if let Some(replace) = v["specrag"]["replace"].as_str() {
            s.pieces.push((0, replace.to_string()));
            s.text = replace.to_string();
            s.views.push(s.text.clone());
        }
        let choice = &v["choices"][0];
        if let Some(t) = choice["delta"]["content"].as_str() {
            s.pieces.push((s.text.len(), t.to_string()));
            s.text.push_str(t);
            s.views.push(s.text.clone());
        }
        if choice["finish_reason"].is_string() {
            s.last = Some(v.clone());
        }
        if v["usage"].is_object() {
            usage = v["usage"].clone();
        }
    }
    match &mut s.last {
        Some(last) => last["usage"] = usage,
        None => s.errors.push("no chunk with a `finish_reason`".into()),
    }
    if !done {
        s.errors
            .push("the stream did not end with `data: [DONE]`".into());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_retracts_and_replacements_apply_as_the_web_page_applies_them() {
        let sse = "event: token\ndata: {\"text\":\"a\"}\n\n\
                   event: draft\ndata: {\"text\":\"b\"}\n\n\
                   event: draft\ndata: {\"text\":\"c\"}\n\n\
                   event: retract\ndata: {\"tokens\":1}\n\n\
                   event: commit\ndata: {\"text\":\"b\"}\n\n\
                   event: replace\ndata: {\"text\":\"x\"}\n\n\
                   event: token\ndata: {\"text\":\"y\"}\n\n\
                   event: draft\ndata: {\"text\":\"z\"}\n\n\
                   event: done\ndata: {\"answer\":\"xy\"}\n\n";
        let s = rag(sse);
        assert_eq!(s.text, "xy");
        assert!(s.errors.is_empty(), "{:?}", s.errors);
        assert_eq!(s.replacement_chars("xy"), Vec::<String>::new());
    }

    #[test]
    fn a_stop_string_shows_in_a_piece_or_split_across_pieces() {
        let chunk =
            |t: &str| format!("data: {{\"choices\":[{{\"delta\":{{\"content\":{t:?}}}}}]}}\n\n");
        let end =
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        let clean = openai(&format!("{}{}{end}", chunk("ab"), chunk("c")));
        assert!(clean.errors.is_empty(), "{:?}", clean.errors);
        assert_eq!(clean.stop_leaks("cd"), Vec::<String>::new());
        let split = openai(&format!("{}{}{end}", chunk("abc"), chunk("dX")));
        assert_eq!(
            split.stop_leaks("cd").len(),
            1,
            "{:?}",
            split.stop_leaks("cd")
        );
        let whole = openai(&format!("{}{}{end}", chunk("ab"), chunk("cdX")));
        assert_eq!(whole.stop_leaks("cd").len(), 2);
        // Withdrawn drafts count while they are shown.
        let drafted = rag("event: commit\ndata: {\"text\":\"ab\"}\n\n\
                           event: draft\ndata: {\"text\":\"c\"}\n\n\
                           event: draft\ndata: {\"text\":\"d\"}\n\n\
                           event: retract\ndata: {\"tokens\":2}\n\n\
                           event: done\ndata: {\"answer\":\"ab\"}\n\n");
        assert_eq!(drafted.text, "ab");
        assert_eq!(drafted.stop_leaks("cd").len(), 1);
    }

    #[test]
    fn a_replacement_char_counts_only_where_the_answer_lacks_one() {
        let s = Shown {
            pieces: vec![(0, "a\u{FFFD}".into()), (4, "\u{FFFD}".into())],
            ..Default::default()
        };
        assert_eq!(s.replacement_chars("a\u{FFFD}\u{FFFD}").len(), 0);
        assert_eq!(s.replacement_chars("a\u{FFFD}é").len(), 1);
    }
}
