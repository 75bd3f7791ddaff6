//! Constrained decoding: what a generation's output must match (a JSON schema, any JSON object,
//! a regular expression, a Lark grammar, one of some strings), enforced by llguidance.
//!
//! A constraint belongs to one generation, like its stop strings. It masks nothing it does not
//! have to: the sampler picks a token from the logits as usual, and only when the constraint
//! rejects that token are the logits masked to what it allows and sampled again (as mistral.rs
//! does), so a step whose first pick fits costs one token check, not a mask over the vocabulary.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

/// What a generation's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// A JSON document valid against this JSON schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (whole).
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's dialect).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl ConstraintSpec {
    /// The grammar llguidance compiles for this spec.
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_json_options(schema.clone())),
            Self::JsonObject => {
                TopLevelGrammar::from_json_schema(with_json_options(serde_json::json!({"type": "object"})))
            }
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Self::Choice(options) => {
                // Lark string literals take JSON's escapes.
                let alternatives: Vec<String> =
                    options.iter().map(|o| serde_json::to_string(o).unwrap_or_default()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
        }
    }

    /// What kind of constraint this is, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "JSON schema",
            Self::JsonObject => "JSON object",
            Self::Regex(_) => "regular expression",
            Self::Lark(_) => "Lark grammar",
            Self::Choice(_) => "choice",
        }
    }
}

/// llguidance's JSON options, unless the schema sets its own (`x-guidance`):
/// - whitespace between tokens is bounded, as llama.cpp's schema grammars bound it: with
///   llguidance's default (any run of it) a small model that wants to write something the schema
///   forbids can pad with spaces until its token budget runs out, where a bounded run makes it
///   write the next token of the document (3 of 37 schemas of the corpus in BENCHMARKS.md);
/// - `oneOf` is taken as `anyOf` (llguidance refuses it otherwise): the branches of real
///   schemas are told apart by a `const` or `required` key, so the two agree on them.
fn with_json_options(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{1,24}", "coerce_one_of": true}),
        );
    }
    schema
}

/// A compiled constraint following one generation's tokens.
pub struct Constraint {
    matcher: Matcher,
    /// Tokens checked without a mask, and masks computed (a rejected first pick), for cost reports.
    checks: usize,
    masks: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("checks", &self.checks).field("masks", &self.masks).finish()
    }
}

impl Constraint {
    /// Compiles `spec` over the vocabulary of `factory`; a spec llguidance cannot take (a schema
    /// keyword it does not support, an empty choice, a bad regular expression) is an error
    /// naming what is wrong, before any step.
    pub fn new(spec: &ConstraintSpec, factory: &Arc<ParserFactory>) -> Result<Self, String> {
        if let ConstraintSpec::Choice(options) = spec {
            if options.is_empty() {
                return Err("a choice needs at least one string".into());
            }
        }
        let parser = factory.create_parser(spec.grammar()).map_err(|e| format!("{}: {e}", spec.kind()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(format!("{}: {e}", spec.kind()));
        }
        Ok(Self { matcher, checks: 0, masks: 0 })
    }

    /// Whether `token` may come next.
    pub fn allows(&mut self, token: u32) -> bool {
        self.checks += 1;
        matches!(self.matcher.validate_tokens(&[token]), Ok(1))
    }

    /// Sets every logit the constraint does not allow next to minus infinity; false when it
    /// allows nothing (the grammar cannot continue).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<bool, String> {
        self.masks += 1;
        let allowed = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        let mut any = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if allowed.is_allowed(id as u32) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(any)
    }

    /// Moves past `token` (which `allows` accepted).
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the output is complete and nothing more may follow.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the output so far is complete (it could end here).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// How many masks were computed (first picks the constraint rejected).
    pub fn masks_computed(&self) -> usize {
        self.masks
    }
}
