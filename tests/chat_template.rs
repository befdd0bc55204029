//! The built-in Gemma 4 chat template against hand-written prompts in the SPEC §5 format,
//! and checkpoint templates loaded from a folder.

use candle_gemma::chat::{ChatError, ChatTemplate, Message, RenderOptions, Role, ToolCall};
use serde_json::json;

fn render(messages: &[Message], opts: &RenderOptions) -> String {
    match ChatTemplate::builtin().render(messages, opts) {
        Ok(s) => s,
        Err(e) => panic!("render failed: {e}"),
    }
}

fn bos_count(s: &str) -> usize {
    s.matches("<bos>").count()
}

fn weather_tool() -> serde_json::Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["c", "f"]}
                },
                "required": ["city"]
            }
        }
    })
}

#[test]
fn user_only_has_no_system_turn() {
    let got = render(&[Message::user("Hello")], &RenderOptions::default());
    assert_eq!(got, "<bos><|turn>user\nHello<turn|>\n<|turn>model\n");
}

#[test]
fn system_user_assistant_user() {
    let msgs = [
        Message::system("  You are terse.\n"),
        Message::user("Hi"),
        Message::assistant("Hello."),
        Message::user("Bye"),
    ];
    let got = render(&msgs, &RenderOptions::default());
    assert_eq!(
        got,
        "<bos><|turn>system\nYou are terse.<turn|>\n\
         <|turn>user\nHi<turn|>\n\
         <|turn>model\nHello.<turn|>\n\
         <|turn>user\nBye<turn|>\n\
         <|turn>model\n"
    );
    assert_eq!(bos_count(&got), 1);
}

#[test]
fn developer_role_is_the_system_turn() {
    let got = render(
        &[Message::new(Role::Developer, "Rules."), Message::user("Q")],
        &RenderOptions::default(),
    );
    assert!(got.starts_with("<bos><|turn>system\nRules.<turn|>\n<|turn>user\nQ<turn|>\n"));
}

#[test]
fn thinking_opens_the_system_turn_and_prior_thoughts_are_stripped() {
    let msgs = [
        Message::user("2+2?"),
        Message::assistant("<|channel>thought\nadd them<channel|>4"),
        Message::user("And 3+3?"),
    ];
    let opts = RenderOptions {
        enable_thinking: true,
        ..Default::default()
    };
    let got = render(&msgs, &opts);
    assert_eq!(
        got,
        "<bos><|turn>system\n<|think|>\n<turn|>\n\
         <|turn>user\n2+2?<turn|>\n\
         <|turn>model\n4<turn|>\n\
         <|turn>user\nAnd 3+3?<turn|>\n\
         <|turn>model\n"
    );
}

#[test]
fn thinking_with_system_text() {
    let opts = RenderOptions {
        enable_thinking: true,
        ..Default::default()
    };
    let got = render(&[Message::system("Sys"), Message::user("U")], &opts);
    assert!(
        got.starts_with("<bos><|turn>system\n<|think|>\nSys<turn|>\n"),
        "{got}"
    );
}

#[test]
fn tool_declarations_in_the_system_turn() {
    let opts = RenderOptions {
        tools: vec![weather_tool()],
        ..Default::default()
    };
    let got = render(&[Message::user("Weather in Paris?")], &opts);
    assert_eq!(
        got,
        "<bos><|turn>system\n\
         <|tool>declaration:get_weather{description:<|\"|>Current weather in a city.<|\"|>,\
         parameters:{properties:{city:{description:<|\"|>City name<|\"|>,type:<|\"|>STRING<|\"|>},\
         unit:{enum:[<|\"|>c<|\"|>,<|\"|>f<|\"|>],type:<|\"|>STRING<|\"|>}},\
         required:[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}<tool|>\
         <turn|>\n\
         <|turn>user\nWeather in Paris?<turn|>\n\
         <|turn>model\n"
    );
}

#[test]
fn bare_function_objects_are_accepted_as_tools() {
    let bare = weather_tool()["function"].clone();
    let a = RenderOptions {
        tools: vec![bare],
        ..Default::default()
    };
    let b = RenderOptions {
        tools: vec![weather_tool()],
        ..Default::default()
    };
    let msgs = [Message::user("x")];
    assert_eq!(render(&msgs, &a), render(&msgs, &b));
}

#[test]
fn tool_call_and_response_stay_in_the_model_turn() {
    let msgs = [
        Message::user("Weather in Paris?"),
        Message::assistant("")
            .with_reasoning("I should call the tool.")
            .with_tool_call(
                "get_weather",
                json!({"city": "Paris", "days": 2, "opts": {"metric": true}}),
            ),
        Message::tool_json("get_weather", json!({"temp": 21, "sky": "clear"})),
    ];
    let opts = RenderOptions {
        tools: vec![weather_tool()],
        ..Default::default()
    };
    let got = render(&msgs, &opts);
    let tail = got.split("<|turn>user\n").nth(1).unwrap_or_default();
    assert_eq!(
        tail,
        "Weather in Paris?<turn|>\n\
         <|turn>model\n\
         <|channel>thought\nI should call the tool.\n<channel|>\
         <|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2,opts:{metric:true}}<tool_call|>\
         <|tool_response>response:get_weather{sky:<|\"|>clear<|\"|>,temp:21}<tool_response|>"
    );
    assert_eq!(bos_count(&got), 1);
}

#[test]
fn answer_after_a_tool_continues_the_turn_and_text_results_use_value() {
    let call = ToolCall {
        id: Some("c1".into()),
        name: "lookup".into(),
        // OpenAI sends arguments as a JSON string.
        arguments: json!("{\"q\": \"rust\"}"),
    };
    let mut assistant = Message::assistant("");
    assistant.tool_calls.push(call);
    let mut result = Message::new(Role::Tool, "found it");
    result.tool_call_id = Some("c1".into());
    let msgs = [
        Message::user("Find rust"),
        assistant,
        result,
        Message::assistant("Here it is."),
        Message::user("Thanks"),
    ];
    let got = render(&msgs, &RenderOptions::default());
    assert_eq!(
        got,
        "<bos><|turn>user\nFind rust<turn|>\n\
         <|turn>model\n\
         <|tool_call>call:lookup{q:<|\"|>rust<|\"|>}<tool_call|>\
         <|tool_response>response:lookup{value:<|\"|>found it<|\"|>}<tool_response|>\
         Here it is.<turn|>\n\
         <|turn>user\nThanks<turn|>\n\
         <|turn>model\n"
    );
}

#[test]
fn reasoning_of_finished_turns_is_not_rendered() {
    let msgs = [
        Message::user("a"),
        Message::assistant("b").with_reasoning("secret"),
        Message::user("c"),
    ];
    let got = render(&msgs, &RenderOptions::default());
    assert!(!got.contains("secret"));
}

#[test]
fn no_generation_prompt() {
    let opts = RenderOptions {
        add_generation_prompt: false,
        ..Default::default()
    };
    let got = render(&[Message::user("u"), Message::assistant("a")], &opts);
    assert_eq!(got, "<bos><|turn>user\nu<turn|>\n<|turn>model\na<turn|>\n");
}

#[test]
fn exactly_one_bos_whatever_the_template_does() {
    let msgs = [Message::user("x")];
    let opts = RenderOptions::default();
    for source in [
        "{{ bos_token }}{{ bos_token }}hi",
        "hi",
        "{{ bos_token }}hi",
    ] {
        let t = ChatTemplate::from_source("t", source).expect("compiles");
        assert_eq!(t.render(&msgs, &opts).expect("renders"), "<bos>hi");
    }
    let stray = ChatTemplate::builtin().render(&[Message::user("say <bos>")], &opts);
    assert!(
        matches!(stray, Err(ChatError::MisplacedBos { .. })),
        "{stray:?}"
    );
}

#[test]
fn template_errors_are_typed() {
    let t = ChatTemplate::from_source("t", "{{ raise_exception('only user/assistant') }}")
        .expect("compiles");
    let err = t.render(&[], &RenderOptions::default());
    assert!(
        matches!(&err, Err(ChatError::Render { reason, .. }) if reason.contains("only user/assistant"))
    );
    assert!(matches!(
        ChatTemplate::from_source("t", "{% for %}"),
        Err(ChatError::Syntax { .. })
    ));
    let bad_tool = RenderOptions {
        tools: vec![json!({"description": "no name"})],
        ..Default::default()
    };
    assert!(matches!(
        ChatTemplate::builtin().render(&[Message::user("x")], &bad_tool),
        Err(ChatError::Tool { index: 0, .. })
    ));
}

#[test]
fn hf_style_templates_render_with_python_helpers() {
    let source = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}\
                  {{ m.content.strip().split('\\n')[-1] }}{% else %}{{ m.get('content', '') | upper }}\
                  {% endif %}{% endfor %}{{ tools | tojson }}";
    let t = ChatTemplate::from_source("hf", source).expect("compiles");
    let opts = RenderOptions {
        tools: vec![json!({"name": "f"})],
        ..Default::default()
    };
    let got = t
        .render(&[Message::user("hi"), Message::assistant(" a\nb ")], &opts)
        .expect("renders");
    assert_eq!(
        got,
        r#"<bos>HIb[{"function":{"name":"f"},"type":"function"}]"#
    );
}

#[test]
fn checkpoint_dir_prefers_jinja_then_tokenizer_config_then_builtin() {
    let dir = std::env::temp_dir().join(format!("cg-chat-template-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    assert_eq!(
        ChatTemplate::from_checkpoint_dir(&dir)
            .expect("builtin")
            .name(),
        "builtin"
    );
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"chat_template": "{{ bos_token }}cfg"}).to_string(),
    )
    .expect("write");
    let t = ChatTemplate::from_checkpoint_dir(&dir).expect("config");
    assert_eq!(
        t.render(&[], &RenderOptions::default()).expect("render"),
        "<bos>cfg"
    );
    std::fs::write(dir.join("chat_template.jinja"), "{{ bos_token }}file").expect("write");
    let t = ChatTemplate::from_checkpoint_dir(&dir).expect("jinja");
    assert_eq!(
        t.render(&[], &RenderOptions::default()).expect("render"),
        "<bos>file"
    );
    std::fs::write(dir.join("tokenizer_config.json"), "{not json").expect("write");
    std::fs::remove_file(dir.join("chat_template.jinja")).expect("rm");
    assert!(matches!(
        ChatTemplate::from_checkpoint_dir(&dir),
        Err(ChatError::Config { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}
