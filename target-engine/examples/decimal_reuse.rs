//! Issue 39's decimal artifact, reproduced at the engine level: passages stating decimals
//! ("3.8 million", "81.4"), questions about them, answered greedily by a full prefill and by
//! reused chunk KV (each chunk precomputed after the template prefix, nothing recomputed),
//! with the teacher-forced logit margin of the decimal's next digit over a lone space (what
//! "3. 8" takes) under both. `--controls` adds the chunks' exact in-context KV stored as f16
//! (what f16 storage alone changes) and ρ = 1 (must equal the full prefill).
//!
//! `cargo run --release -p target-engine --example decimal_reuse -- MODEL.gguf
//! [--filler FILE] [--rotations N] [--max-tokens N] [--controls]`: the context is the three
//! numeric passages plus two filler chunks (from FILE, ~350 words each), rotated N times so
//! the answer sits at different chunk positions.
use target_engine::prelude::*;
use target_engine::{ChunkKv, GenerateParams, KvCache, LoadOptions, Model, RagTemplate};

const FILLER: &str = "The river valley was settled by farmers in the twelfth century. \
Trade along the old road brought merchants, and a market charter followed in 1352. \
The town hall, rebuilt after a fire, now houses the regional archive and a small museum.";

const PASSAGES: [&str; 3] = [
    r#"Lakeford is the capital and largest city of the province of Eastmarch. It lies on the northern shore of Lake Verran, at the mouth of the Ardle river, about 40 kilometres from the border. Founded as a fishing village in the early medieval period, it grew into a trading port during the Hanseatic era and became the seat of the provincial government in 1814.

According to the 2020 census, the Lakeford metropolitan area had a population of 3.8 million, up from 3.1 million in 2010, making it the third-largest urban area in the country. The city proper had 1.2 million inhabitants. The median age was 38.6 years, and 24.3 percent of residents were born abroad. The population density of the city proper is 4,210 inhabitants per square kilometre.

The economy of Lakeford is dominated by services, logistics and manufacturing. The port handled 41.7 million tonnes of cargo in 2019. The largest employers are the provincial government, the university hospital and the shipbuilder Verran Yards, which employs about 9,000 people. Unemployment stood at 5.9 percent in 2021.

Lakeford has a humid continental climate with warm summers and cold winters. The average temperature in January is -4.2 degrees Celsius and in July 19.8 degrees Celsius. Annual precipitation averages 712 millimetres, most of it falling in late summer.

The city is served by Lakeford International Airport, 18 kilometres to the west, and by a tram network of 11 lines. The central railway station opened in 1872 and was rebuilt in 1998."#,
    r#"The Orsova Dam is a concrete arch dam on the Tarn river in the southern highlands. It was built between 1961 and 1968 to provide hydroelectric power and flood control for the lower valley. The dam is 142 metres high and its crest is 410 metres long.

The reservoir created by the dam, Lake Orsova, covers an area of 81.4 square kilometres and holds 2.6 cubic kilometres of water at full supply level. It flooded three villages, whose 2,300 inhabitants were resettled in new towns further down the valley. The remains of the church of Saint Elian can still be seen when the water level is low.

The power station at the foot of the dam has four Francis turbines with a combined capacity of 560 megawatts, and produces on average 1.9 terawatt-hours of electricity per year. A second station, added in 1985, pumps water back into the reservoir at night.

The dam was designed by the engineer Petra Vasilescu, whose thin-arch design used 38 percent less concrete than a gravity dam of the same height. It was listed as a historic engineering landmark in 2011."#,
    r#"Mira Halvorsen (born 14 March 2001) is a Norwegian sprinter who specialises in the 100 and 200 metres. She grew up in Bergen and started athletics at the age of eleven, coached by her father, a former decathlete.

At the 2019 national championships she ran the 100 metres in 11.27 seconds, a national junior record, and won the 200 metres in 23.05 seconds. In 2021 she reached the semi-final of the European Under-23 Championships in Tallinn, where she finished fourth in her heat in 11.41 seconds.

Her personal bests are 11.18 seconds in the 100 metres, set in Oslo in 2022, and 22.87 seconds in the 200 metres. She studies sports science at the Norwegian School of Sport Sciences."#,
];

const QUESTIONS: [&str; 12] = [
    "What was the population of the Lakeford metropolitan area in 2020?",
    "What was the population of the Lakeford metropolitan area in 2010?",
    "What was the median age in Lakeford?",
    "What share of Lakeford's residents were born abroad?",
    "How much cargo did the port of Lakeford handle in 2019?",
    "What is the average July temperature in Lakeford?",
    "What area does Lake Orsova cover?",
    "How much water does Lake Orsova hold?",
    "How much electricity does the Orsova power station produce per year?",
    "What time did Mira Halvorsen run in the 100 metres at the 2019 national championships?",
    "What is Mira Halvorsen's personal best in the 200 metres?",
    "What was Mira Halvorsen's time in her heat in Tallinn?",
];

/// Teacher-forces `answer` from a prefilled `cache` whose last logits are `logits`, and returns,
/// at every step that continues a decimal (`digit "." | digit`), the logit of the answer's digit
/// minus that of a lone space (what "3. 8" would take).
fn decimal_margins(
    m: &Model,
    cache: &mut KvCache,
    mut logits: Vec<f32>,
    answer: &[u32],
) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    let tok = m.tokenizer();
    let space = tok.encode(" 8", false).ids[0];
    let is_digit = |id: u32| {
        let t = tok.decode(&[id], false);
        !t.is_empty() && t.chars().all(|c| c.is_ascii_digit())
    };
    let dot = tok.encode(".", false).ids[0];
    let mut out = Vec::new();
    for (i, &id) in answer.iter().enumerate() {
        if i >= 2 && answer[i - 1] == dot && is_digit(answer[i - 2]) && is_digit(id) {
            out.push(logits[id as usize] - logits[space as usize]);
        }
        let pos = cache.len();
        let o = m.forward(&[id], &[pos], cache, false)?;
        logits = m.last_logits(&o)?;
    }
    Ok(out)
}

#[allow(
    clippy::too_many_lines,
    reason = "a measurement script that reads top to bottom: parse, run, print"
)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().ok_or("usage: decimal_reuse MODEL.gguf")?;
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let max_tokens: usize = flag("--max-tokens").map_or(Ok(32), |s| s.parse())?;
    let rotations: usize = flag("--rotations").map_or(Ok(1), |s| s.parse())?;
    let controls = args.iter().any(|a| a == "--controls");
    let filler: Vec<String> = match flag("--filler") {
        Some(f) => {
            let text = std::fs::read_to_string(f)?;
            let words: Vec<&str> = text.split_whitespace().collect();
            words.chunks(350).map(|w| w.join(" ")).take(2).collect()
        }
        None => vec![FILLER.to_string(); 2],
    };
    let m = Model::load(model.as_ref(), &LoadOptions::default())?;
    let tok = m.tokenizer();
    let t = RagTemplate::default();
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    let mut base: Vec<&str> = PASSAGES.to_vec();
    base.extend(filler.iter().map(String::as_str));
    let (mut n, mut spaced_full, mut spaced_reuse, mut differ) = (0, 0, 0, 0);
    let spaced = |s: &str| {
        let b = s.as_bytes();
        (2..b.len()).any(|i| {
            b[i - 2] == b'.'
                && b[i - 1] == b' '
                && b[i].is_ascii_digit()
                && i >= 3
                && b[i - 3].is_ascii_digit()
        })
    };
    for r in 0..rotations {
        let mut docs = base.clone();
        let k = r % docs.len();
        docs.rotate_left(k);
        for question in QUESTIONS {
            let asm = t.assemble(tok, &docs, question);
            let prefix = m.prefix_kv(&asm.ids[asm.prefix_range()])?;
            let kvs: Vec<ChunkKv> = asm
                .chunks()
                .map(|s| m.precompute(&asm.ids[s.ids.clone()], Some(&prefix)))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&ChunkKv> = kvs.iter().collect();
            let (mut full_cache, full_logits) = m.prefill(&asm.ids)?;
            let full = m.decode_from(&mut full_cache.clone(), full_logits.clone(), 0.0, &params)?;
            let full_m = decimal_margins(&m, &mut full_cache, full_logits, &full.ids)?;
            let out = m.blend_prefill(&asm, &prefix, &refs, &[])?;
            let reuse = m.decode_from(&mut out.cache.clone(), out.logits.clone(), 0.0, &params)?;
            let mut cache = out.cache;
            let reuse_m = decimal_margins(&m, &mut cache, out.logits, &full.ids)?;
            n += 1;
            spaced_full += usize::from(spaced(&full.text));
            spaced_reuse += usize::from(spaced(&reuse.text));
            differ += usize::from(full.ids != reuse.ids);
            println!("== rotation {r}, {} tokens: {question}", asm.ids.len());
            println!("full   {:?}", full.text);
            println!("reuse  {:?}", reuse.text);
            println!("digit-minus-space logit after \"d.\": full {full_m:?} reuse {reuse_m:?}");
            if controls {
                // The chunks' KV as the full prefill computed it (exact context and positions),
                // stored as f16 like any chunk: what rounding alone changes.
                let (cache, _) = m.prefill(&asm.ids)?;
                let exact: Vec<ChunkKv> = asm
                    .chunks()
                    .map(|s| {
                        m.chunk_rows(
                            &cache,
                            &asm.ids[s.ids.clone()],
                            s.ids.start,
                            kvs[0].mode.clone(),
                        )
                    })
                    .collect();
                let refs: Vec<&ChunkKv> = exact.iter().collect();
                let mut out = m.blend_prefill(&asm, &prefix, &refs, &[])?;
                let g = m.decode_from(&mut out.cache, out.logits, 0.0, &params)?;
                println!("f16    {:?} (same as full: {})", g.text, g.ids == full.ids);
                let mut out = m.blend_prefill(&asm, &prefix, &refs, &asm.chunk_positions())?;
                let g = m.decode_from(&mut out.cache, out.logits, 0.0, &params)?;
                println!("rho=1  same as full: {}", g.ids == full.ids);
            }
        }
    }
    println!(
        "{n} answers: reuse differs from full in {differ}; \"d. d\" in full {spaced_full}, in reuse {spaced_reuse}"
    );
    Ok(())
}
