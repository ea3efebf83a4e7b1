//! The chat format a prompt is written in: the GGUF file's own template
//! (`tokenizer.chat_template`, Jinja as Hugging Face renders it, through minijinja), or ChatML
//! for a file without one.
//!
//! A RAG prompt is one system turn and one user turn whose content is the documents and the
//! question, then the generation prompt. The template is rendered once, at load, with marker
//! strings for the two contents; the text around the markers is what every prompt puts before
//! the system text (`pre`), between it and the user content (`mid`) and after the user content
//! (`post`). Chunks are precomputed after `pre + system + mid` (the prefix), so the boundary is
//! the template's own, and a different template gives a different prefix and chunk key.

use crate::config::Architecture;
use crate::tokenizer::Tokenizer;
use minijinja::{context, Environment, Error as JinjaError, ErrorKind};

/// Where a [`ChatFormat`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatSource {
    /// The model file's `tokenizer.chat_template`.
    File,
    /// ChatML written by hand: the file has no template (or it did not render; the reason).
    ChatMl(Option<String>),
    /// The turn format the file's family is known to use, written by hand (a Gemma 3 file
    /// without a template).
    Family(&'static str),
}

/// The text a chat template puts around a turn's contents (control tokens in it are parsed as
/// special tokens; contents never are).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatFormat {
    /// Before the system text, between it and the user content, after the user content (the
    /// generation prompt included).
    pub with_system: [String; 3],
    /// Before and after the user content of a prompt without a system turn.
    pub user_only: [String; 2],
    /// Whether the ids start with the tokenizer's BOS: the tokenizer asks for one and the
    /// template does not write it.
    pub bos: bool,
    pub source: ChatSource,
}

/// Markers standing for the contents while the template renders (private-use characters: no
/// template transforms them, no real text holds them).
const SYSTEM_MARK: &str = "\u{E000}system\u{E001}";
const USER_MARK: &str = "\u{E000}user\u{E001}";

/// Bound on a template's work (minijinja's fuel: roughly instructions): templates come with
/// model files, so a hostile one must not hang the load.
const FUEL: u64 = 1_000_000;

impl ChatFormat {
    /// ChatML as Qwen and SmolLM2 write it.
    pub fn chatml() -> Self {
        Self {
            with_system: [
                "<|im_start|>system\n".into(),
                "<|im_end|>\n<|im_start|>user\n".into(),
                "<|im_end|>\n<|im_start|>assistant\n".into(),
            ],
            user_only: [
                "<|im_start|>user\n".into(),
                "<|im_end|>\n<|im_start|>assistant\n".into(),
            ],
            bos: false,
            source: ChatSource::ChatMl(None),
        }
    }

    /// Gemma's turns, as Gemma 3's own template writes them: no system role (the system text
    /// opens the user turn, a blank line after it), `model` for the assistant, BOS first.
    pub fn gemma(tok: &Tokenizer) -> Self {
        Self {
            with_system: [
                "<start_of_turn>user\n".into(),
                "\n\n".into(),
                "<end_of_turn>\n<start_of_turn>model\n".into(),
            ],
            user_only: [
                "<start_of_turn>user\n".into(),
                "<end_of_turn>\n<start_of_turn>model\n".into(),
            ],
            bos: tok.add_bos(),
            source: ChatSource::Family("gemma"),
        }
    }

    /// The format `tok`'s model file declares: its template rendered; without one, its
    /// family's known format (Gemma's for `gemma3`) or ChatML; ChatML too when the template
    /// does not render (logged, and the reason kept in [`ChatFormat::source`]).
    pub fn for_tokenizer(tok: &Tokenizer, template: Option<&str>, arch: Architecture) -> Self {
        let Some(src) = template else {
            if arch == Architecture::Gemma3 {
                return Self::gemma(tok);
            }
            let mut f = Self::chatml();
            f.bos = tok.add_bos();
            return f;
        };
        match Self::from_template(tok, src) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("the model's chat template does not render ({e}): using ChatML");
                let mut f = Self::chatml();
                f.bos = tok.add_bos();
                f.source = ChatSource::ChatMl(Some(e));
                f
            }
        }
    }

    /// Renders `src` (a Hugging Face chat template) for a system turn and a user turn, and for
    /// a user turn alone, with the generation prompt and thinking off (`enable_thinking`:
    /// false, which Qwen3's template reads); splits the text at the contents. A template that
    /// refuses a system turn (some Mistral ones) gets the system text at the start of the user
    /// turn, as those templates' own models are prompted.
    pub fn from_template(tok: &Tokenizer, src: &str) -> Result<Self, String> {
        let text = |id: Option<u32>| id.map(|i| tok.decode(&[i], true)).unwrap_or_default();
        let (bos_text, eos_text) = (text(tok.bos()), text(tok.eos()));
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        let tmpl = env
            .template_from_str(src)
            .map_err(|e| format!("it does not parse: {e}"))?;
        let render = |messages: Vec<minijinja::Value>| -> Result<String, String> {
            tmpl.render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => bos_text,
                eos_token => eos_text,
                enable_thinking => false,
            })
            .map_err(|e| e.to_string())
        };
        let msg = |role: &str, content: &str| context! { role => role, content => content };
        let user_only = split(&render(vec![msg("user", USER_MARK)])?, &[USER_MARK])?;
        let with_system = match render(vec![msg("system", SYSTEM_MARK), msg("user", USER_MARK)]) {
            Ok(t) => split(&t, &[SYSTEM_MARK, USER_MARK])?,
            Err(_) => split(
                &render(vec![msg("user", &format!("{SYSTEM_MARK}\n\n{USER_MARK}"))])?,
                &[SYSTEM_MARK, USER_MARK],
            )?,
        };
        let [pre, mid, post] = <[String; 3]>::try_from(with_system).map_err(|_| "split")?;
        let [upre, upost] = <[String; 2]>::try_from(user_only).map_err(|_| "split")?;
        let writes_bos = !bos_text.is_empty() && pre.starts_with(&bos_text);
        Ok(Self {
            with_system: [pre, mid, post],
            user_only: [upre, upost],
            bos: tok.add_bos() && !writes_bos,
            source: ChatSource::File,
        })
    }

    /// Ids of the text before the system content (BOS first when the format needs one).
    pub fn head_ids(&self, tok: &Tokenizer, system: bool) -> Vec<u32> {
        let mut ids = Vec::new();
        if self.bos {
            ids.extend(tok.bos());
        }
        let pre = if system {
            &self.with_system[0]
        } else {
            &self.user_only[0]
        };
        ids.extend(tok.encode(pre, true).ids);
        ids
    }

    /// The text after the user content (the end of the turn and the generation prompt).
    pub fn post(&self, system: bool) -> &str {
        if system {
            &self.with_system[2]
        } else {
            &self.user_only[1]
        }
    }

    /// Ids of one prompt: `system` (if any) and `user` as contents (never parsed for control
    /// tokens), the rest of the text as the template writes it.
    pub fn prompt(&self, tok: &Tokenizer, system: Option<&str>, user: &str) -> Vec<u32> {
        let mut ids = self.head_ids(tok, system.is_some());
        if let Some(s) = system {
            ids.extend(tok.encode(s, false).ids);
            ids.extend(tok.encode(&self.with_system[1], true).ids);
        }
        ids.extend(tok.encode(user, false).ids);
        ids.extend(tok.encode(self.post(system.is_some()), true).ids);
        ids
    }

    /// The whole prompt's text (what the template renders for these contents).
    pub fn text(&self, system: Option<&str>, user: &str) -> String {
        match system {
            Some(s) => {
                let [pre, mid, post] = &self.with_system;
                format!("{pre}{s}{mid}{user}{post}")
            }
            None => format!("{}{user}{}", self.user_only[0], self.user_only[1]),
        }
    }
}

/// Splits `text` at each of `marks` (each exactly once, in order): the pieces around them.
fn split(text: &str, marks: &[&str]) -> Result<Vec<String>, String> {
    let mut pieces = Vec::new();
    let mut rest = text;
    for m in marks {
        if text.matches(m).count() != 1 {
            return Err(format!(
                "a message's content appears {} times in the rendered prompt (expected once, unchanged)",
                text.matches(m).count()
            ));
        }
        let (before, after) = rest.split_once(m).ok_or("the contents come out of order")?;
        pieces.push(before.to_string());
        rest = after;
    }
    pieces.push(rest.to_string());
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn split_needs_each_mark_once_and_in_order() {
        assert_eq!(
            split("a<S>b<U>c", &["<S>", "<U>"]).expect("split"),
            ["a", "b", "c"]
        );
        assert!(split("a<U>b<S>c", &["<S>", "<U>"]).is_err());
        assert!(split("a<S>b<S>c<U>", &["<S>", "<U>"]).is_err());
        assert!(split("abc", &["<S>"]).is_err());
    }
}
