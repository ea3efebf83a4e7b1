//! The RAG prompt written through the model file's own chat template: what the template
//! renders for the system text and a user turn holding the documents and the question, split
//! where the chunks are precomputed; ChatML only where a file has no template (or one that
//! does not render).

use minijinja::{context, Environment};
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, ChatSource, LoadOptions, Model, RagTemplate};

/// Llama 3's template (its shape: the role headers, `| trim`, BOS on the first message).
const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Gemma 3's: no system role (its text opens the first user turn), roles must alternate.
const GEMMA3: &str = "{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = \"\" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = \"model\" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}";

/// Mistral's early template: a system message is refused.
const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

/// Qwen3's generation prompt: thinking stays off for RAG answers.
const QWEN3: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}";

fn tiny_with_template(template: Option<&str>) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    let mut spec = TinySpec::new(Architecture::Qwen2);
    if let Some(t) = template {
        spec.extra.push((
            "tokenizer.chat_template".into(),
            candle_core::quantized::gguf_file::Value::String(t.into()),
        ));
    }
    write_tiny_gguf(&path, &spec).expect("write");
    let m = Model::load(&path, &LoadOptions::default()).expect("load");
    (dir, m)
}

/// The template rendered as Hugging Face renders it (trimmed and left-stripped blocks).
fn render(template: &str, messages: Vec<minijinja::Value>) -> String {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |m: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                m,
            ))
        },
    );
    env.template_from_str(template)
        .expect("parses")
        .render(context! {
            messages => messages, add_generation_prompt => true, bos_token => "",
            eos_token => "<|im_end|>", enable_thinking => false,
        })
        .expect("renders")
}

const DOCS: [&str; 2] = ["the ant ran in the sand", "the antenna is in the attic"];

#[test]
fn the_rag_prompt_is_what_the_files_template_renders() {
    for (name, template) in [("llama3", LLAMA3), ("gemma3", GEMMA3), ("qwen3", QWEN3)] {
        let (_d, m) = tiny_with_template(Some(template));
        assert_eq!(m.chat().source, ChatSource::File, "{name}");
        let t = RagTemplate::for_model(&m);
        let asm = t.assemble(m.tokenizer(), &DOCS, "where is the antenna?");
        let user = "Document: the ant ran in the sand\n\nDocument: the antenna is in the attic\n\nQuestion: where is the antenna?";
        let want = render(
            template,
            vec![
                context! { role => "system", content => t.system.clone() },
                context! { role => "user", content => user },
            ],
        );
        assert_eq!(asm.text, want, "{name}");
        // The prefix that chunks are precomputed after is the template's text up to the
        // user content, and the question segment ends with its generation prompt.
        let (prefix, _) = t.prefix(m.tokenizer());
        assert!(
            want.starts_with(&prefix) && prefix.contains(&t.system),
            "{name}"
        );
        assert!(!prefix.contains("Document:"), "{name}");
        // Each segment's ids are its text tokenized (contents as text, the template's
        // control text parsed), in order.
        let ids: Vec<u32> = asm
            .segments
            .iter()
            .flat_map(|s| asm.ids[s.ids.clone()].to_vec())
            .collect();
        assert_eq!(ids, asm.ids);
    }
    let (_d, m) = tiny_with_template(Some(QWEN3));
    assert!(RagTemplate::for_model(&m)
        .assemble(m.tokenizer(), &DOCS, "q")
        .text
        .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

#[test]
fn a_template_that_refuses_a_system_turn_gets_it_in_the_user_turn() {
    let (_d, m) = tiny_with_template(Some(MISTRAL));
    assert_eq!(m.chat().source, ChatSource::File);
    let t = RagTemplate::for_model(&m);
    let asm = t.assemble(m.tokenizer(), &DOCS, "where?");
    let user = format!(
        "{}\n\nDocument: the ant ran in the sand\n\nDocument: the antenna is in the attic\n\nQuestion: where?",
        t.system
    );
    assert_eq!(
        asm.text,
        render(MISTRAL, vec![context! { role => "user", content => user }])
    );
    assert!(asm.text.ends_with(" [/INST]"));
}

#[test]
fn a_file_without_a_usable_template_is_prompted_in_chatml() {
    let (_d, none) = tiny_with_template(None);
    assert_eq!(none.chat().source, ChatSource::ChatMl(None));
    let chatml = RagTemplate::default()
        .assemble(none.tokenizer(), &DOCS, "q")
        .text;
    assert!(chatml.starts_with("<|im_start|>system\n"));
    assert_eq!(
        RagTemplate::for_model(&none)
            .assemble(none.tokenizer(), &DOCS, "q")
            .text,
        chatml
    );
    // A template that does not parse, one that leaves the content out, and one whose work has
    // no bound: ChatML, with the reason kept, and the load does not hang.
    let t = std::time::Instant::now();
    for bad in [
        "{% for m in messages %}{{ m.content ",
        "{{ '<s>' }}{% if add_generation_prompt %}assistant:{% endif %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0].content }}{% endfor %}{% endfor %}",
    ] {
        let (_d, m) = tiny_with_template(Some(bad));
        assert!(
            matches!(m.chat().source, ChatSource::ChatMl(Some(_))),
            "{bad}: {:?}",
            m.chat().source
        );
        assert_eq!(
            RagTemplate::for_model(&m)
                .assemble(m.tokenizer(), &DOCS, "q")
                .text,
            chatml
        );
    }
    assert!(t.elapsed().as_secs() < 20, "{:?}", t.elapsed());
}

/// A Gemma 3 file without a template (Gemma 3 270M's GGUF has none) is prompted in Gemma's
/// turns, as Gemma 3's own template would write them, not in ChatML.
#[test]
fn a_gemma3_file_without_a_template_gets_gemmas_turns() {
    let (_, spec) = target_engine::testing::family_specs()
        .into_iter()
        .find(|(n, _)| *n == "tiny-gemma3")
        .expect("gemma3 spec");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &spec).expect("write");
    let m = Model::load(&path, &LoadOptions::default()).expect("load");
    assert_eq!(m.chat().source, ChatSource::Family("gemma"));
    let t = RagTemplate::for_model(&m);
    let asm = t.assemble(m.tokenizer(), &DOCS, "where is the antenna?");
    let user = "Document: the ant ran in the sand\n\nDocument: the antenna is in the attic\n\nQuestion: where is the antenna?";
    let want = render(
        GEMMA3,
        vec![
            context! { role => "system", content => t.system.clone() },
            context! { role => "user", content => user },
        ],
    );
    assert_eq!(asm.text, want);
}

mod common;

/// The default models carry templates that render ChatML exactly: their RAG prompts, prefixes
/// and so chunk keys are what the hand-written ChatML gave them.
#[test]
fn the_default_models_templates_render_chatml() {
    for file in [common::QWEN_05B, common::SMOLLM2, common::QWEN_15B] {
        let m = Model::load(
            &common::model_path(file),
            &LoadOptions {
                warmup: false,
                ..Default::default()
            },
        )
        .expect("load");
        assert_eq!(m.chat().source, ChatSource::File, "{file}");
        let chatml = target_engine::ChatFormat::chatml();
        assert_eq!(m.chat().with_system, chatml.with_system, "{file}");
        let (a, b) = (
            RagTemplate::for_model(&m).assemble(m.tokenizer(), &DOCS, "q"),
            RagTemplate::default().assemble(m.tokenizer(), &DOCS, "q"),
        );
        assert_eq!(a, b, "{file}");
        eprintln!("{file}: user turn alone: {:?}", m.chat().user_only);
    }
}
