//! Chat templates: the model's Jinja template rendered with `minijinja`, configured as Hugging
//! Face's `apply_chat_template` does (trim_blocks, lstrip_blocks, Python string methods).

use crate::{RuntimeError, TextTokenizer};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub fn render_chat(
    tok: &TextTokenizer,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<String, RuntimeError> {
    let template = tok.chat_template.as_deref().ok_or_else(|| {
        RuntimeError::Template("the model's tokenizer_config.json has no chat_template".into())
    })?;
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| RuntimeError::Template(e.to_string()))?;
    let t = env
        .get_template("chat")
        .map_err(|e| RuntimeError::Template(e.to_string()))?;
    t.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => tok.bos_token.clone().unwrap_or_default(),
        eos_token => tok.eos_token.clone().unwrap_or_default(),
    })
    .map_err(|e| RuntimeError::Template(e.to_string()))
}
