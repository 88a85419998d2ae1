//! The built-in sample corpus the fast path is checked against the HuggingFace tokenizer on
//! before it is trusted: one text per character class and whitespace shape the pre-tokenizer
//! regexes treat differently. None contains an added token.

/// Texts covering prose, code, numbers, scripts, emoji, combining marks and whitespace runs.
pub const SELF_CHECK_CORPUS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog. KV caches evict under pressure.",
    "It's what they'd've said: we'll see, you're right, I'm sure, they've gone, he'd 't.",
    "  Leading spaces, trailing spaces   ",
    "Tabs\tand\t\ttabs, runs of spaces     before words and before newlines    \nand the end   ",
    "fn main() {\n    let mut total = 0u64;\n\tfor i in 0..10 {\n\t\ttotal += i * 3;\n    }\n}\n",
    "def f(x):\r\n    return x ** 2  # square\r\n\r\n\r\nprint(f(12))\r\n",
    "{\"id\": 1234567, \"pi\": 3.14159, \"list\": [1, 22, 333, 4444], \"ok\": true, \"s\": \"a\\nb\"}",
    "Numbers: 1234567 and 3.14 and 1,000,000 and 0x1F and 2024-11-29T16:32:56Z and ١٢٣٤٥ and ⅷ ½",
    "Wow!!!\n\nReally?? (yes) -- [maybe] ... $x = @y + %z; #tag .Hello ,world 'quoted' \"dq\"",
    "中文文本的分词测试，包括标点符号。我们在2024年发布了新版本！",
    "日本語のテキスト：ひらがな、カタカナ、漢字。ﾊﾝｶｸｶﾀｶﾅも。",
    "한국어 텍스트도 포함합니다. 안녕하세요!",
    "النص العربي مع علامات الترقيم، والأرقام ١٢٣.",
    "Русский текст с пунктуацией — и «кавычками».",
    "Ελληνικά, עברית, हिन्दी पाठ, ภาษาไทย, Tiếng Việt có dấu.",
    "Emoji 😀👍🏽 and ZWJ 👩‍👩‍👧‍👦 🏳️‍🌈 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "Combining: e\u{301} a\u{308}\u{304} n\u{303} Z\u{0336}a\u{0337}l\u{0338}g\u{0335}o",
    "Odd spaces:\u{a0}nbsp\u{2003}em\u{3000}ideographic\u{200b}zwsp\u{feff}bom\u{85}nel\u{2028}ls\u{b}vt\u{c}ff",
    "Mixed\r\nline\rendings\n\r\n \n\t\n  \r\n  x\n\n\n",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html> https://example.com/a?b=c&d=e#f",
    "math: ∑_{i=1}^{n} x_i² ≤ √(α·β) → ∞; set ∈ ∅ ∪ ℝ",
    "ALLCAPS camelCaseWords snake_case_words kebab-case-words SCREAMING_SNAKE",
    "a\u{0}b\u{1}c\u{7f}d \u{1b}[31mred\u{1b}[0m",
    "",
    " ",
    "\n",
    "   \n\n   ",
];
