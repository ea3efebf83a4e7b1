//! Seeded cases long and alike enough to tell KV-reuse methods apart, unlike the ~90-token
//! bridge chunks of [`crate::datasets`]: multi-hop questions over encyclopedia-style profiles
//! of 200-400 words full of same-kind facts ([`profile_cases`]), and lookups and comparisons
//! over short reference records that share every field ([`record_cases`]).

use crate::datasets::{Case, CaseDoc};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;

/// Name syllables (another set than `datasets.rs`, so the two datasets never share names).
const SYL: [&str; 40] = [
    "bra", "den", "fal", "gor", "hal", "iv", "jor", "kel", "lan", "mo", "nes", "ob", "pra", "quen",
    "ril", "sten", "tav", "ul", "vor", "wen", "yar", "zan", "cal", "dre", "esk", "fin", "gra",
    "hom", "ist", "lud", "mav", "nor", "pel", "ren", "sol", "tir", "ur", "vek", "wil", "ax",
];
const FEMALE: [&str; 24] = [
    "Anna", "Clara", "Edith", "Freya", "Greta", "Helena", "Ida", "Johanna", "Karin", "Lena",
    "Marta", "Nora", "Olga", "Paula", "Rosa", "Sofia", "Tilda", "Ursula", "Vera", "Wilma", "Agnes",
    "Berta", "Dora", "Elsa",
];
const MALE: [&str; 24] = [
    "Anton", "Bruno", "Carl", "David", "Emil", "Felix", "Georg", "Hugo", "Isak", "Jonas", "Karl",
    "Leon", "Magnus", "Nils", "Oskar", "Petter", "Rudolf", "Simon", "Tomas", "Viktor", "Walter",
    "Aron", "Bernt", "Erik",
];

/// An element chosen by the rng (the slices here are never empty).
fn pick<T: Copy>(rng: &mut StdRng, xs: &[T]) -> T {
    xs[rng.gen_range(0..xs.len())]
}

fn words(s: &str) -> usize {
    s.split_whitespace().count()
}

/// A person: given name, generated surname, and which pronouns the prose uses.
struct Person {
    given: String,
    sur: String,
    female: bool,
}

impl Person {
    fn full(&self) -> String {
        format!("{} {}", self.given, self.sur)
    }
}

/// Generated names of one dataset: none repeats, and none equals a given name.
struct Names(HashSet<String>);

impl Names {
    fn new() -> Self {
        Self(FEMALE.iter().chain(&MALE).map(|s| s.to_string()).collect())
    }

    /// A fresh word starting with syllable `first` (longer once short ones run out).
    fn word_from(&mut self, rng: &mut StdRng, first: &str, parts: usize) -> String {
        let (mut parts, mut tries) = (parts, 0);
        loop {
            let mut s = first.to_string();
            for _ in 1..parts {
                s.push_str(pick(rng, &SYL));
            }
            let s = s[..1].to_uppercase() + &s[1..];
            if self.0.insert(s.clone()) {
                return s;
            }
            tries += 1;
            if tries % 64 == 0 {
                parts += 1;
            }
        }
    }

    fn word(&mut self, rng: &mut StdRng) -> String {
        let first = pick(rng, &SYL);
        self.word_from(rng, first, 3)
    }

    fn person(&mut self, rng: &mut StdRng) -> Person {
        let female = rng.gen_bool(0.5);
        self.person_of(rng, female)
    }

    fn person_of(&mut self, rng: &mut StdRng, female: bool) -> Person {
        let given = pick(rng, if female { &FEMALE } else { &MALE }).to_string();
        let sur = self.word(rng);
        Person { given, sur, female }
    }
}

/// Template values: `{key}` in a template becomes the value.
#[derive(Default)]
struct Vars(Vec<(String, String)>);

impl Vars {
    fn set(&mut self, key: &str, value: impl ToString) {
        self.0.push((format!("{{{key}}}"), value.to_string()));
    }

    /// Sets `key` to one of the `|`-separated `choices`.
    fn choose(&mut self, rng: &mut StdRng, key: &str, choices: &str) {
        let xs: Vec<&str> = choices.split('|').collect();
        self.set(key, pick(rng, &xs));
    }

    /// Sets each of the space-separated `keys` to its value.
    fn zip<T: ToString>(&mut self, keys: &str, values: impl IntoIterator<Item = T>) {
        for (k, x) in keys.split(' ').zip(values) {
            self.set(k, x);
        }
    }

    /// Sets each of the space-separated `keys` to a number drawn from `lo..hi`.
    fn nums(&mut self, rng: &mut StdRng, keys: &str, lo: u32, hi: u32) {
        for k in keys.split(' ') {
            self.set(k, rng.gen_range(lo..hi));
        }
    }

    fn render(&self, t: &str) -> String {
        self.0
            .iter()
            .fold(t.to_string(), |s, (k, v)| s.replace(k, v))
    }
}

/// Prose from `paras` (paragraphs split by blank lines, a sentence slot a line, alternatives
/// split by ` | `; one alternative each), then shuffled `extras` (one a line) as up to two more
/// paragraphs until about `target` words.
fn prose(rng: &mut StdRng, v: &Vars, paras: &str, extras: &str, target: usize) -> String {
    let mut ps: Vec<Vec<String>> = vec![Vec::new()];
    for line in paras.trim().lines().map(str::trim) {
        match ps.last_mut() {
            Some(p) if !line.is_empty() => {
                let alts: Vec<&str> = line.split(" | ").collect();
                p.push(v.render(pick(rng, &alts)));
            }
            _ => ps.push(Vec::new()),
        }
    }
    let mut n: usize = ps.iter().flatten().map(|s| words(s)).sum();
    let mut pool: Vec<&str> = extras.trim().lines().map(str::trim).collect();
    pool.shuffle(rng);
    let mut more = [Vec::new(), Vec::new()];
    for (k, e) in pool.into_iter().enumerate() {
        if n >= target {
            break;
        }
        let s = v.render(e);
        n += words(&s);
        more[(k / 4).min(1)].push(s);
    }
    ps.extend(more.into_iter().filter(|p| !p.is_empty()));
    ps.iter()
        .map(|p| p.join(" "))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// A role in an entity: how a question names its holder (`{A}` the entity), the holder's
/// profession, what the holder studied, and which of the entity's years the role starts at.
type Role = (&'static str, &'static str, &'static str, usize);

/// An entity template: its name from the generated word `{w}` and the choice `{c1}`, four roles
/// held by `{r0}`-`{r3}`, choices (`c1|c2`), the paragraphs and the extra facts (see [`prose`]).
struct Kind {
    name: &'static str,
    roles: [Role; 4],
    choices: &'static [&'static str],
    paras: &'static str,
    extras: &'static str,
}

const KINDS: [Kind; 5] = [
    Kind {
        name: "{w} {c1}",
        roles: [
            ("the founder of {A}", "an industrialist", "mechanical engineering", 0),
            ("the chief engineer of {A}", "an engineer", "physics", 1),
            ("the first chairman of {A}", "a banker", "economics", 1),
            ("the chief executive of {A}", "a business executive", "law", 5),
        ],
        choices: &["Instruments|telescopes and surveying instruments", "Motors|delivery vans and farm tractors", "Textiles|wool cloth and carpets", "Optics|camera lenses and microscopes", "Foods|tinned fish and fruit preserves", "Publishing|dictionaries and school books"],
        paras: "
            {A} is a manufacturer of {c2} based in {town}. | {A} is a {town} firm that makes {c2}.
            It was founded in {y1} by {r0}; the founder at first ran it from a rented workshop near the {town} railway station. | Its founder, {r0}, started the business in {y1} with {s1} employees and a loan from an uncle.
            When the firm was incorporated in {y2}, {r2} became its first chairman. | {r2} served as the first chairman of the board after the company was incorporated in {y2}.

            Its first product, the {w1}, sold {b1} units in the first three years. | The first product to carry the name was the {w1}, of which {b1} were sold by {y3}.
            The chief engineer, {r1}, designed the {w2} series, which stayed in production until {y5}. | Much of the technical work was led by {r1}, chief engineer from {y2}, whose {w2} series stayed in the catalogue until {y5}.
            A second factory opened in {town2} in {y3}, and by {y4} the company employed {m1} people. | By {y4} the workforce had grown to {m1}, spread over the original site and a new plant in {town2}.

            In {y4} {A} bought its smaller rival {w3} Works, which had {m2} workers in {town3}. | The company took over the {town3} firm {w3} Works in {y4}, adding {m2} workers.
            The present chief executive, {r3}, took office in {y6}. | Since {y6} the company has been run by its chief executive, {r3}.
            Annual sales reached {b2} units in {y6}, and about {pct} percent of the output is exported. | About {pct} percent of the output is now sold abroad, and annual sales stand at {b2} units.

            In {y5} the head office moved from {town} to a former cotton mill in {town3}. | The head office has been in a former cotton mill in {town3} since {y5}.
            A foundation set up by {extra3} holds the largest block of shares. | The largest shareholder is a foundation set up by {extra3}.
            Abroad it runs {s5} subsidiaries, and its research laboratory employs {m5} people. | It has {s5} subsidiaries abroad and a research laboratory with {m5} staff.",
        extras: "
            A history of the company by {extra} appeared in {y5} and runs to {m3} pages.
            The original workshop in {town} was turned into a small museum in {y6}.
            For {s2} years after {y3} the plant in {town2} also made spare parts for railway wagons.
            The apprentice school of the firm, opened in {y3}, has trained more than {m4} young workers.
            Its trademark, a white star on a blue ground, was registered in {y2} and has hardly changed since.
            {extra2} was head of sales for {s3} years and opened agencies in {s4} countries.
            A strike in {y4} closed the plant in {town2} for {s6} weeks.
            The {w2} won a gold medal at the trade fair in {town4} in {y3}.
            In its first decade the company shipped most of its goods by barge along the canal to {town4}.
            The firm sponsors a rowing club and a brass band in {town}, both founded by its workers.
            A fire in {y6} destroyed the drawing office, and {m6} original drawings were lost.",
    },
    Kind {
        name: "{w}",
        roles: [
            ("the lead singer of the band {A}", "a singer", "music", 0),
            ("the drummer of the band {A}", "a drummer", "music", 0),
            ("the bass guitarist of the band {A}", "a musician", "history", 0),
            ("the manager of the band {A}", "a music manager", "economics", 1),
        ],
        choices: &["folk rock|", "jazz|", "post-punk|", "country|", "progressive rock|", "blues|"],
        paras: "
            {A} is a {c1} band formed in {town} in {y1}. | {A} are a {c1} group from {town}, formed in {y1}.
            The founding line-up was the lead singer {r0}, the drummer {r1} and the bass guitarist {r2}. | Its founding members were {r0} (lead singer), {r1} (drummer) and {r2} (bass guitarist).
            {r3} has been the manager of the band since {y2}. | The manager of the band since {y2} has been {r3}, who also books its tours.

            Their debut album, {w1}, was recorded in {s1} days in a barn outside {town2} and released in {y2}. | The debut album {w1} came out in {y2}; it was recorded in {s1} days in a barn near {town2}.
            The follow-up, {w2}, reached number {s2} in the national chart in {y3}. | {w2}, released in {y3}, reached number {s2} in the national chart.
            The band has played more than {m1} concerts, including a {s7}-date tour in {y4}. | Over the years {A} has played more than {m1} concerts; the tour of {y4} alone had {s7} dates.

            A second guitarist, {extra}, joined in {y4} and co-wrote the third album, {w3}. | In {y4} the guitarist {extra} joined, and co-wrote the third album, {w3}.
            In {y5} the band played a reunion concert in {town3} before {b1} people. | {b1} people attended the reunion concert in {town3} in {y5}.
            Their records have sold about {b2} copies. | Sales of their records are estimated at {b2} copies.

            In all, {A} has released {s5} studio albums and {s6} live recordings. | The band has released {s5} studio albums and {s6} live records.
            Most of the lyrics were written by {r0}, who drew on stories heard in the harbour taverns of {town}. | {r0} wrote most of the lyrics, drawing on stories heard in the harbour taverns of {town}.
            {extra3} produced the first two albums, recording them with a mobile studio in a converted bus. | The producer of the first two albums was {extra3}, who recorded them in a converted bus.",
        extras: "
            The name of the band comes from a ferry that crossed the lake near {town} until {y1}.
            Critics in {town2} praised the close harmonies of the band and its use of the accordion.
            A documentary about the band, directed by {extra2}, was shown on television in {y6}.
            The band rehearsed for {s3} years in the back room of a bakery in {town}.
            Its song about the floods of {y3} was kept off the radio for {s4} months.
            A fan club founded in {y3} had {m3} members at its peak, most of them in {town4}.
            In {y4} a music magazine in {town4} named {A} the best live act of the year.
            After {y5} the band took a break of {s4} years, during which the members pursued other work.
            The instruments of the early years are on display in the music museum of {town2}.
            Their best-known song, {w4}, has been recorded by more than {m4} other artists.
            The cover of {w1} shows a lighthouse painted by a schoolfriend of the band.",
    },
    Kind {
        name: "{w}",
        roles: [
            ("the first captain of the ship {A}", "a sea captain", "navigation", 0),
            ("the designer of the ship {A}", "a naval architect", "naval architecture", 0),
            ("the first chief engineer of the ship {A}", "a marine engineer", "mechanical engineering", 0),
            ("the first owner of the ship {A}", "a timber merchant", "economics", 0),
        ],
        choices: &["cargo steamer|", "passenger ferry|", "three-masted barque|", "coastal freighter|", "research vessel|"],
        paras: "
            The {A} is a {c1} launched in {y1} at the {town} shipyard. | {A} was a {c1}, launched at the yard in {town} in {y1}.
            Her designer was the naval architect {r1}, and she measured {len} metres. | Her designer, {r1}, gave her a length of {len} metres and a shallow hull for river ports.
            Her first owner was {r3}, a timber merchant who kept her until {y3}. | The timber merchant {r3} ordered the ship and was her first owner until {y3}.

            Her first captain was {r0}, who took her on the {town2} to {town3} route for {s1} years. | Under her first captain, {r0}, she sailed the {town2} to {town3} route for {s1} years.
            Her first chief engineer, {r2}, kept the engines running through the storms of {y2}. | The engines were in the care of her first chief engineer, {r2}, during the storms of {y2}.
            She carried {m2} passengers and {b1} tonnes of cargo in a typical year. | In a typical year she carried {b1} tonnes of cargo and {m2} passengers.

            From {y4} she was commanded by {extra}. | {extra} took command in {y4}, after the first captain had left.
            In {y5} she was sold to owners in {town4} and renamed {w1}. | She was sold in {y5} to a company in {town4}, which renamed her {w1}.
            She was broken up in {y6}; her bell hangs in the harbour office of {town}. | Her career ended in {y6}, and her bell is kept in the harbour office of {town}.

            Her hull was of riveted steel, divided into {s5} watertight compartments. | She had a riveted steel hull with {s5} watertight compartments.
            She was registered at {town} under number {m5}. | Her home port was {town}, where she was registered under number {m5}.
            In the winter of {y3} ice held her for {s6} weeks off {town4}. | During the winter of {y3} she was trapped in the ice off {town4} for {s6} weeks.",
        extras: "
            Her sister ship, the {w2}, was launched {s2} months later from the same slipway.
            In {y3} she rescued {s3} fishermen from a sinking trawler off {town3}.
            A model of the ship, built by {extra2}, is on display in the maritime museum of {town2}.
            Her engines developed {m3} horsepower and gave her a speed of {s4} knots.
            The ship was refitted in {y4} with electric lighting and a larger galley.
            Her log books, {m4} volumes in all, survive in the port archive.
            A painting of the ship leaving {town2}, by {extra3}, hangs in the town hall there.
            Her figurehead, a carved swan, was removed in {y4} and later sold at auction.
            The crew quarters were rebuilt in {y5} to sleep {m6} sailors.
            A song about her last voyage is still sung in the harbour pubs of {town3}.
            One of her anchors lies today in a park in {town4}.",
    },
    Kind {
        name: "{w}",
        roles: [
            ("the current mayor of {A}", "a politician", "law", 5),
            ("the architect of the town hall of {A}", "an architect", "architecture", 1),
            ("the headmaster of the grammar school in {A}", "a teacher", "history", 5),
            ("the founder of the museum in {A}", "a historian", "history", 3),
        ],
        choices: &["market town|trade, brewing and tanning", "mining town|coal, iron and brick making", "port town|fishing, shipbuilding and trade", "spa town|hotels, baths and tourism", "mill town|paper, timber and textiles"],
        paras: "
            {A} is a {c1} on the river {w1}, with a population of {b1}. | {A} is a {c1} of {b1} inhabitants on the river {w1}.
            It received its town charter in {y1}, and the railway reached it in {y3}. | The town charter dates from {y1}; the railway arrived in {y3}.
            Its neighbours are {town2} to the north and {town3} to the east. | The nearest towns are {town2}, to the north, and {town3}, to the east.

            The current mayor, {r0}, was elected in {y6} with {pct} percent of the vote. | {r0}, the current mayor, was elected in {y6} with {pct} percent of the vote.
            The previous mayor, {extra}, had served {s1} terms. | {r0} succeeded {extra}, who had been mayor for {s1} terms.
            The town hall, designed by the architect {r1}, was completed in {y2} after {s2} years of work. | The architect of the town hall was {r1}; the building was finished in {y2} after {s2} years of work.

            The grammar school has {m1} pupils; its headmaster is {r2}. | {r2} is the headmaster of the grammar school, which has {m1} pupils.
            The founder of the museum in {A}, {r3}, opened it in {y4}; it holds {b2} objects, mostly tools and maps. | The museum, whose founder was {r3}, opened in {y4} and holds {b2} objects, mostly tools and maps.
            {A} is twinned with {town4}. | Since {y5} {A} has been twinned with {town4}.

            The main industries are {c2}, and about {pct2} percent of the workers commute to {town2}. | Most jobs are in {c2}; about {pct2} percent of workers commute to {town2}.
            The old town has {m5} listed buildings, among them a watchtower from {y1}. | Among the {m5} listed buildings of the old town is a watchtower from {y1}.
            The western quarter burned in {y2} and was rebuilt on a regular grid. | A fire in {y2} destroyed the western quarter, which was rebuilt to a regular plan.",
        extras: "
            A weekly market has been held on the main square since {y1}.
            The stone bridge over the {w1}, built in {y2}, has {s3} arches.
            The parish church contains an organ built in {y4} by {extra2}.
            Floods in {y5} damaged {m3} houses in the lower town.
            The football club, founded in {y3}, plays in a stadium for {b3} spectators.
            A hospital with {m4} beds opened on the hill above the river in {y5}.
            The writer {extra3} lived in {A} for {s6} years and set two novels there.
            The annual horse fair draws about {m6} traders every autumn.
            A tram line to {town3} ran from {y4} until {y6}.
            The local newspaper, the {w2} Courier, was founded in {y3}.
            The coat of arms of the town shows a silver fish below three towers.",
    },
    Kind {
        name: "{w} College",
        roles: [
            ("the first rector of {A}", "a scholar", "philosophy", 1),
            ("the founder of {A}", "a merchant", "economics", 0),
            ("the head librarian of {A}", "a librarian", "classics", 5),
            ("the first dean of medicine at {A}", "a physician", "medicine", 2),
        ],
        choices: &["public college|", "technical college|", "teachers' college|", "private college|"],
        paras: "
            {A} is a {c1} in {town}; its founder, the merchant {r1}, established it in {y1}. | {A}, a {c1} in {town}, was founded in {y1}; its founder was the merchant {r1}.
            Its first rector, {r0}, was appointed in {y2} and served for {s1} years. | The first rector was {r0}, appointed in {y2}, who led the college for {s1} years.
            The college has {b1} students in {s2} faculties. | About {b1} students are enrolled in its {s2} faculties.

            The library holds {b2} volumes, including the {w1} manuscripts; the head librarian is {r2}. | {r2}, the head librarian, looks after {b2} volumes, among them the {w1} manuscripts.
            The faculty of medicine opened in {y3}, with {r3} as its first dean. | When the faculty of medicine opened in {y3}, {r3} became its first dean of medicine.
            The present rector, {extra}, was elected in {y6}. | Since {y6} the college has been led by the rector {extra}.

            In {y4} the college opened an observatory on the hill above {town2}. | An observatory on the hill above {town2} was added in {y4}.
            It exchanges students with colleges in {town3} and {town4}. | Exchange agreements link it with colleges in {town3} and {town4}.
            Its motto, chosen in {y1}, means light through work. | The coat of arms, granted in {y2}, shows an open book and the {w2} tower.

            Degrees are offered in {s5} subjects; engineering and education draw the most students. | The college offers degrees in {s5} subjects, the largest being engineering and education.
            The painter {extra3} is among its best-known graduates. | Among its best-known graduates is the painter {extra3}.
            Until {y5} tuition was free, and about {pct2} percent of students still receive grants. | Tuition was free until {y5}; today about {pct2} percent of students receive grants.",
        extras: "
            The main building, a former granary, was converted in {y2} at a cost of {b3} crowns.
            {m1} members of staff teach at the college, {pct} percent of them part-time.
            The botanical garden behind the library has {m2} species of trees.
            A fire in {y5} destroyed {m3} volumes, which were replaced by gifts from {extra2}.
            The student choir has toured {s3} countries and recorded {s4} albums.
            Its rowing club races every spring against the crew of {w3} Academy.
            The college newspaper, founded in {y3}, appears every two weeks.
            Its museum of anatomy holds {m5} specimens gathered by the faculty of medicine.
            A new campus on the edge of {town} opened in {y6} with {m6} rooms.
            Students traditionally wear a green cap after passing their first examinations.
            The college owns a research farm of {m4} hectares near {town4}.",
    },
];

/// One generated entity: the holders of its four roles and its years.
struct Entity {
    text: String,
    roles: Vec<Person>,
    years: [u32; 6],
}

/// Profile of a new entity of `kind` whose generated name starts with syllable `first`;
/// returns its full name and the entity.
fn entity(rng: &mut StdRng, names: &mut Names, kind: &Kind, first: &str) -> (String, Entity) {
    let w = names.word_from(rng, first, 3);
    let (c1, c2) = pick(rng, kind.choices).split_once('|').unwrap_or(("", ""));
    let a = kind.name.replace("{w}", &w).replace("{c1}", c1);
    let mut v = Vars::default();
    v.zip("A c1 c2", [a.as_str(), c1, c2]);
    let mut years = [rng.gen_range(1820..1900); 6];
    for (j, gap) in [(1, 2..9), (2, 3..13), (3, 2..11), (4, 4..21), (5, 1..7)] {
        years[j] = years[j - 1] + rng.gen_range(gap);
    }
    v.zip("y1 y2 y3 y4 y5 y6", years);
    let roles: Vec<Person> = (0..4).map(|_| names.person(rng)).collect();
    v.zip("r0 r1 r2 r3", roles.iter().map(Person::full));
    for k in "extra extra2 extra3".split(' ') {
        v.set(k, names.person(rng).full());
    }
    for k in "town town2 town3 town4 w1 w2 w3 w4".split(' ') {
        v.set(k, names.word(rng));
    }
    v.nums(rng, "s1 s2 s3 s4 s5 s6 s7", 2, 13);
    v.nums(rng, "m1 m2 m3 m4 m5 m6", 20, 480);
    v.nums(rng, "b1 b2 b3", 1200, 95000);
    v.nums(rng, "pct pct2", 12, 89);
    v.nums(rng, "len", 30, 140);
    let target = rng.gen_range(240..320);
    let text = prose(rng, &v, kind.paras, kind.extras, target);
    (a, Entity { text, roles, years })
}

const PERSON: &str = "
    {name} ({by}–{dy}) was {prof} whose working life spanned {career} years. | {name} ({by}–{dy}) was {prof}, remembered in {emptown} for {his} years at {emp} Works.
    {sur} was born in {born} in {by}, the {ord} of {kids0} children of a {parentjob}. | Born in {by} in the town of {born}, {sur} was the {ord} of {kids0} children of a {parentjob}.
    When {he} was {age}, the family moved to {moved}, where {his} father found work at the {w1} mill. | The family left {born} for {moved} when {he} was {age}, and {he} went to school there.
    {His} younger {sibrel}, {sib}, was born in {moved} and later settled in {sibtown}. | A younger {sibrel}, {sib}, was born in {moved} {s1} years later and eventually made a home in {sibtown}.

    {sur} studied {subject} at the University of {uni}, graduating in {gy}. | In {gy0} {he} enrolled at the University of {uni} to study {subject}, and graduated in {gy}.
    {His} {sibrel} {sibgiven} went on to study law at the University of {sibuni}. | {sibgiven} later studied medicine at the University of {sibuni}, the path the family had expected of {sur}.
    From {ty} {he} taught at the University of {uni2} for {s3} years, giving lectures on {subject}. | After graduating {he} spent {s3} years teaching at the University of {uni2}.

    In {jy} {he} joined {emp} Works in {emptown}, where {he} rose to lead a department of {m1} staff. | {He} moved to {emptown} in {jy} to join {emp} Works, and within a decade led a department of {m1} staff.
    {He} married {spouse}, a {spousejob} from {spousetown}, in {my}; they had {kids} children. | In {my} {sur} married {spouse} of {spousetown}, a {spousejob}; the couple had {kids} children.
    {sur} received the {award} Medal in {ay} and published {m2} articles over {his} career. | Among {his} honours was the {award} Medal, awarded in {ay}; {he} also wrote {m2} articles and {s4} books.

    {sur} retired to {retire} in {ry} and spent {his} last years there {hobby}. | In {ry} {he} retired to the coastal town of {retire}, where {he} spent {his} time {hobby}.
    {He} died in {dy} in a hospital in {deathtown}, aged {dage}. | {He} died at {deathtown} in {dy}, at the age of {dage}.
    A street in {moved} is named after {him}. | {His} papers, {m3} boxes in all, are kept in the archive of {emptown}.";

const PERSON_EXTRAS: &str = "
    As a student {he} spent a summer working at the {w2} boatyard, an experience {he} often described in interviews.
    {He} spoke {s5} languages and corresponded with colleagues in {m4} towns.
    In {xy} {he} travelled for {s6} months through the mountain districts, keeping a diary of {m5} pages.
    Friends described {sur} as patient, precise and fond of long walks before breakfast.
    {His} portrait, painted in {py} by {painter}, hangs in the town hall of {emptown}.
    {sur} was a keen chess player and for {s7} years chaired the chess club of {emptown}.
    In {xy2} {he} stood for the town council of {emptown} and lost by {m6} votes.
    A collection of {his} letters to {spouse} was published {s8} years after {his} death.";

/// Profile of person `p` holding `role` from year `anchor`; returns the text and its answers to
/// the three question kinds ([`ASKS`]): birthplace, university, town retired to.
fn person(
    rng: &mut StdRng,
    names: &mut Names,
    p: &Person,
    role: &Role,
    anchor: u32,
) -> (String, [String; 3]) {
    let mut v = Vars::default();
    let pron = if p.female {
        "she She her Her her"
    } else {
        "he He his His him"
    };
    v.zip("he He his His him", pron.split(' '));
    v.zip(
        "name sur prof subject",
        [p.full(), p.sur.clone(), role.1.into(), role.2.into()],
    );
    let sib_female = rng.gen_bool(0.5);
    let sibgiven = loop {
        let g = pick(rng, if sib_female { &FEMALE } else { &MALE });
        if g != p.given {
            break g;
        }
    };
    v.set("sib", format!("{sibgiven} {}", p.sur));
    v.set("sibgiven", sibgiven);
    v.set("sibrel", if sib_female { "sister" } else { "brother" });
    let answers = [names.word(rng), names.word(rng), names.word(rng)];
    v.zip("born uni retire", &answers);
    let places = "moved sibtown sibuni uni2 emp emptown spousetown deathtown award w1 w2";
    for k in places.split(' ') {
        v.set(k, names.word(rng));
    }
    v.set("spouse", names.person_of(rng, !p.female).full());
    v.set("painter", names.person(rng).full());
    let by = anchor - rng.gen_range(28..45);
    let (gy, teach, ord) = (
        by + rng.gen_range(21..25),
        rng.gen_range(2..9),
        rng.gen_range(0..3),
    );
    let ty = gy + rng.gen_range(1..4);
    let jy = ty + teach;
    let ry = by + rng.gen_range(60..68);
    let dy = ry + rng.gen_range(3..19);
    v.zip(
        "by gy gy0 ty s3 jy ry dy",
        [by, gy, gy - 4, ty, teach, jy, ry, dy],
    );
    v.zip(
        "dage career kids0",
        [dy - by, ry - gy, ord + 3 + rng.gen_range(0..3)],
    );
    for (k, base, lo, hi) in [("my", jy, 1, 5), ("ay", jy, 5, 16), ("xy", gy, 5, 20)] {
        v.set(k, base + rng.gen_range(lo..hi));
    }
    for (k, base, lo, hi) in [("xy2", jy, 2, 20), ("py", jy, 10, 20), ("age", 0, 4, 13)] {
        v.set(k, base + rng.gen_range(lo..hi));
    }
    v.set("ord", ["eldest", "second", "third"][ord as usize]);
    v.nums(rng, "s1 s4 s5 s6 s7 s8 kids", 2, 10);
    v.nums(rng, "m1 m2 m3 m4 m5 m6", 20, 400);
    let parents = "miller|schoolteacher|blacksmith|fisherman|railway clerk";
    v.choose(rng, "parentjob", parents);
    v.choose(rng, "spousejob", "painter|pharmacist|translator|nurse");
    let hobbies = "keeping bees|restoring old clocks|writing a memoir|fishing";
    v.choose(rng, "hobby", hobbies);
    let target = rng.gen_range(240..320);
    (prose(rng, &v, PERSON, PERSON_EXTRAS, target), answers)
}

/// Settings of the profile generator.
#[derive(Debug, Clone, Copy)]
pub struct ProfileParams {
    pub cases: usize,
    /// Documents per case: the two gold profiles plus distractors (at least 2).
    pub documents: usize,
    pub seed: u64,
}

impl Default for ProfileParams {
    fn default() -> Self {
        Self {
            cases: 16,
            documents: 5,
            seed: 0,
        }
    }
}

const ASKS: [&str; 3] = [
    "In which town was {q} born?",
    "At which university did {q} study?",
    "To which town did {q} retire?",
];

/// Multi-hop cases over 200-400-word profiles: the question names entity A and a role; A's
/// profile names the role's holder B among other people; B's profile holds the answer beside
/// other towns and universities. Distractors, in order: an entity of A's kind whose name shares
/// A's first syllable, the profile of its holder of the same role, the profile of A's holder of
/// another role, then other entities and their holders.
pub fn profile_cases(p: &ProfileParams) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let mut names = Names::new();
    let mut out = Vec::with_capacity(p.cases);
    for i in 0..p.cases {
        let kind = &KINDS[i % KINDS.len()];
        let ask = (i / KINDS.len()) % ASKS.len();
        let role = rng.gen_range(0..4);
        let first = pick(&mut rng, &SYL);
        let (a, ent) = entity(&mut rng, &mut names, kind, first);
        let anchor = |e: &Entity, r: usize| e.years[kind.roles[r].3];
        let holder = (&ent.roles[role], &kind.roles[role], anchor(&ent, role));
        let (b_text, answers) = person(&mut rng, &mut names, holder.0, holder.1, holder.2);
        let doc = |tag: &str, text: String| CaseDoc {
            id: format!("prof{i}-{tag}"),
            text,
        };
        let mut docs = vec![doc("a", ent.text.clone()), doc("b", b_text)];
        let gold = docs.iter().map(|d| d.id.clone()).collect();
        let other = (role + rng.gen_range(1..4)) % 4;
        let mut last: Option<(&Kind, Entity)> = None;
        for j in 0..p.documents.saturating_sub(2) {
            let text = if j == 2 {
                // A's holder of another role: following the wrong role gives a wrong town.
                let (o, o_role) = (&ent.roles[other], &kind.roles[other]);
                person(&mut rng, &mut names, o, o_role, anchor(&ent, other)).0
            } else if j == 0 || (j > 2 && j % 2 == 1) {
                // An entity: first one of A's kind whose name shares A's first syllable.
                let k = if j == 0 {
                    kind
                } else {
                    &KINDS[rng.gen_range(0..KINDS.len())]
                };
                let f = if j == 0 { first } else { pick(&mut rng, &SYL) };
                let (_, e) = entity(&mut rng, &mut names, k, f);
                let text = e.text.clone();
                last = Some((k, e));
                text
            } else {
                // The holder of the same role in the last entity: reading the wrong entity
                // gives a wrong town.
                let Some((k, e)) = &last else {
                    unreachable!("an entity comes before its holder")
                };
                let y = e.years[k.roles[role].3];
                person(&mut rng, &mut names, &e.roles[role], &k.roles[role], y).0
            };
            docs.push(doc(&format!("d{j}"), text));
        }
        docs.shuffle(&mut rng);
        let q = kind.roles[role].0.replace("{A}", &a);
        out.push(Case {
            id: format!("profile-{i}"),
            question: format!(
                "{} Answer with the name only.",
                ASKS[ask].replace("{q}", &q)
            ),
            answers: vec![answers[ask].clone()],
            documents: docs,
            gold,
            collection: None,
        });
    }
    out
}

/// A record field's kind of value, parsed from its spec in [`RECORDS`].
enum Field<'a> {
    /// `word`: a generated name (a town, a maker).
    Word,
    /// `person`: a full name; given names differ within a case.
    Person,
    /// `year`: 1850..1990; differs within a case.
    Year,
    /// `num LO HI UNIT`: a number in `LO..HI` (then its unit); differs within a case.
    Num(u32, u32, &'a str),
    /// `a, b, c`: a value from a list (may repeat, so never asked).
    Choice(Vec<&'a str>),
}

impl<'a> Field<'a> {
    fn parse(spec: &'a str) -> Self {
        let mut it = spec.splitn(4, ' ');
        match (it.next(), it.next(), it.next()) {
            (Some("word"), None, _) => Self::Word,
            (Some("person"), None, _) => Self::Person,
            (Some("year"), None, _) => Self::Year,
            (Some("num"), Some(lo), Some(hi)) => Self::Num(
                lo.parse().unwrap_or(1),
                hi.parse().unwrap_or(100),
                it.next().unwrap_or(""),
            ),
            _ => Self::Choice(spec.split(", ").collect()),
        }
    }
}

/// Record kinds: heading, the noun questions use, and the fields in order, one a line as
/// `label | how a question names it | spec` (see [`Field`]).
const RECORDS: [(&str, &str, &str); 4] = [
    (
        "Weather station",
        "weather station",
        "
        Region | region | word
        Nearest town | nearest town | word
        Opened | opening year | year
        Elevation | elevation in metres | num 100 3000 metres
        Mean annual rainfall | mean annual rainfall in millimetres | num 300 2600 millimetres
        Sunshine per year | yearly sunshine in hours | num 900 3400 hours
        Record high temperature | record high temperature | num 28 48 degrees
        Frost days per year | number of frost days per year | num 5 160 days
        Wind mast height | wind mast height in metres | num 6 60 metres
        Chief observer | chief observer | person
        Staff | number of staff | num 2 30
        Instruments | number of instruments | num 31 90
        Status | status | active, automated, closed, seasonal",
    ),
    (
        "Pump model",
        "pump model",
        "
        Manufacturer | manufacturer | word
        Assembly plant | assembly plant | word
        Introduced | year of introduction | year
        Rated flow | rated flow in litres per minute | num 40 3000 litres per minute
        Maximum head | maximum head in metres | num 8 240 metres
        Motor power | motor power in watts | num 250 9500 watts
        Weight | weight in kilograms | num 12 900 kilograms
        Impeller diameter | impeller diameter in millimetres | num 80 600 millimetres
        Inlet diameter | inlet diameter in millimetres | num 20 300 millimetres
        Housing | housing material | cast iron, bronze, stainless steel, aluminium
        Designer | designer | person
        List price | list price in crowns | num 400 25000 crowns
        Units sold | number of units sold | num 300 90000",
    ),
    (
        "Mineral",
        "mineral",
        "
        First described | year of first description | year
        Type locality | type locality | word
        Discoverer | discoverer | person
        Named after | person it is named after | person
        Colour | colour | green, deep red, pale yellow, black, violet
        Crystal system | crystal system | cubic, hexagonal, monoclinic, triclinic
        Hardness | hardness | num 2 10 on the Mohs scale
        Density | density in kilograms per cubic metre | num 2100 9800 kilograms per cubic metre
        Melting point | melting point in degrees | num 420 3100 degrees
        Known deposits | number of known deposits | num 2 90
        Largest crystal | largest crystal size in centimetres | num 3 140 centimetres
        Reference collection | reference collection | word",
    ),
    (
        "Railway station",
        "railway station",
        "
        Line | line | word
        Opened | opening year | year
        Platforms | number of platforms | num 2 15
        Tracks | number of tracks | num 16 40
        Platform length | platform length in metres | num 80 420 metres
        Daily passengers | number of daily passengers | num 300 80000
        Distance from the terminus | distance from the terminus in kilometres | num 3 480 kilometres
        Elevation | elevation in metres | num 5 1900 metres
        Parking spaces | number of parking spaces | num 10 900
        Architect | architect | person
        Station master | station master | person
        Nearest town | nearest town | word
        Status | status | open, closed, request stop only, goods only",
    ),
];

/// Settings of the record generator.
#[derive(Debug, Clone, Copy)]
pub struct RecordParams {
    pub cases: usize,
    /// Records per case, all alike (at least 2).
    pub records: usize,
    pub seed: u64,
}

impl Default for RecordParams {
    fn default() -> Self {
        Self {
            cases: 16,
            records: 4,
            seed: 0,
        }
    }
}

/// Whole-word containment of a phrase (names can be substrings of other names).
fn has_phrase(text: &str, phrase: &str) -> bool {
    let words = |s: &str| -> Vec<String> {
        s.split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect()
    };
    let (t, p) = (words(text), words(phrase));
    !p.is_empty() && t.windows(p.len()).any(|w| w == p.as_slice())
}

/// A number in `lo..hi` not in `seen` while the range lasts: (as written, as answered, it).
fn distinct(rng: &mut StdRng, seen: &mut HashSet<u32>, lo: u32, hi: u32, unit: &str) -> Val {
    if seen.len() >= (hi - lo) as usize {
        seen.clear();
    }
    loop {
        let x = rng.gen_range(lo..hi);
        if seen.insert(x) {
            return (
                format!("{x} {unit}").trim_end().to_string(),
                x.to_string(),
                x,
            );
        }
    }
}

/// A record's value: as written, as answered, and the number (0 for names).
type Val = (String, String, u32);

/// Cases over alike reference records (40-80 words, the same fields in the same order):
/// about 60% lookups of one field of one record (answered by that record only) and 40%
/// comparisons of a numeric field between two records (answered with the record's name).
#[allow(
    clippy::too_many_lines,
    reason = "one seeded generator: the draws must stay in this order for the committed cases to be reproduced"
)]
pub fn record_cases(p: &RecordParams) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let mut names = Names::new();
    let n = p.records.max(2);
    let mut out = Vec::with_capacity(p.cases);
    for i in 0..p.cases {
        let (head, noun, spec) = RECORDS[i % RECORDS.len()];
        let fields: Vec<(&str, &str, Field)> = spec
            .trim()
            .lines()
            .filter_map(|l| {
                let mut it = l.trim().splitn(3, " | ");
                Some((it.next()?, it.next()?, Field::parse(it.next()?)))
            })
            .collect();
        let recs: Vec<String> = (0..n).map(|_| names.word(&mut rng)).collect();
        let mut given = HashSet::new();
        let mut values: Vec<Vec<Val>> = Vec::new(); // [field][record]
        for (_, _, field) in &fields {
            let mut seen = HashSet::new();
            let mut value = || match field {
                Field::Word => {
                    let w = names.word(&mut rng);
                    (w.clone(), w, 0)
                }
                Field::Person => loop {
                    if given.len() == FEMALE.len() + MALE.len() {
                        given.clear();
                    }
                    let q = names.person(&mut rng);
                    if given.insert(q.given.clone()) {
                        break (q.full(), q.full(), 0);
                    }
                },
                Field::Year => distinct(&mut rng, &mut seen, 1850, 1990, ""),
                Field::Num(lo, hi, unit) => distinct(&mut rng, &mut seen, *lo, *hi, unit),
                Field::Choice(xs) => (pick(&mut rng, xs).to_string(), String::new(), 0),
            };
            values.push((0..n).map(|_| value()).collect());
        }
        let docs: Vec<CaseDoc> = (0..n)
            .map(|r| {
                let body: Vec<String> = fields
                    .iter()
                    .zip(&values)
                    .map(|((label, _, _), col)| format!("{label}: {}.", col[r].0))
                    .collect();
                CaseDoc {
                    id: format!("rec{i}-{r}"),
                    text: format!("{head} {}. {}", recs[r], body.join(" ")),
                }
            })
            .collect();
        let (question, answer, gold) = if i % 5 % 2 == 0 {
            // Lookup: a value no other record mentions, not even in another field.
            let mut cands: Vec<(usize, usize)> = (0..fields.len())
                .filter(|&f| !matches!(fields[f].2, Field::Choice(_)))
                .flat_map(|f| (0..n).map(move |r| (f, r)))
                .collect();
            cands.shuffle(&mut rng);
            let unique = |&(f, r): &(usize, usize)| {
                (0..n).all(|o| o == r || !has_phrase(&docs[o].text, &values[f][r].1))
            };
            let (f, r) = cands.iter().copied().find(unique).unwrap_or((0, 0));
            let form = match fields[f].2 {
                Field::Year | Field::Num(..) => "number",
                _ => "name",
            };
            let (what, rec) = (fields[f].1, &recs[r]);
            let q = format!("What is the {what} of the {noun} {rec}? Answer with the {form} only.");
            (q, values[f][r].1.clone(), vec![docs[r].id.clone()])
        } else {
            // Comparison: two records, either of which may be named first.
            let nums: Vec<usize> = (0..fields.len())
                .filter(|&f| matches!(fields[f].2, Field::Num(..)))
                .collect();
            let f = pick(&mut rng, &nums);
            let mut two: Vec<usize> = (0..n).collect();
            two.shuffle(&mut rng);
            let (x, y) = (two[0], two[1]);
            let win = if values[f][x].2 > values[f][y].2 {
                x
            } else {
                y
            };
            let q = format!(
                "Which {noun} has the larger {}, {} or {}? Answer with the name only.",
                fields[f].1, recs[x], recs[y]
            );
            let gold = vec![docs[win].id.clone(), docs[x + y - win].id.clone()];
            (q, recs[win].clone(), gold)
        };
        let mut docs = docs;
        docs.shuffle(&mut rng);
        out.push(Case {
            id: format!("record-{i}"),
            question,
            answers: vec![answer],
            documents: docs,
            gold,
            collection: None,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profiles(cases: usize, documents: usize, seed: u64) -> Vec<Case> {
        profile_cases(&ProfileParams {
            cases,
            documents,
            seed,
        })
    }

    fn records(cases: usize, seed: u64) -> Vec<Case> {
        record_cases(&RecordParams {
            cases,
            seed,
            ..RecordParams::default()
        })
    }

    fn text<'a>(c: &'a Case, id: &str) -> &'a str {
        let d = c.documents.iter().find(|d| d.id == id);
        d.map_or_else(|| panic!("{}: no document {id}", c.id), |d| d.text.as_str())
    }

    /// The names a question mentions: its capitalised words after the first.
    fn named(q: &str) -> Vec<&str> {
        q.split(|c: char| !c.is_alphanumeric())
            .filter(|w| w.starts_with(|c: char| c.is_uppercase()))
            .skip(1)
            .filter(|w| *w != "Answer")
            .collect()
    }

    /// What every case must hold: the answer in a gold document and in no other, the named
    /// entities in the gold documents, and rendered, non-empty documents of `range` words.
    fn check(c: &Case, prefix: &str, range: std::ops::RangeInclusive<usize>) {
        let answer = &c.answers[0];
        assert_eq!(c.answers.len(), 1);
        assert!(c.question.ends_with(" only."), "{}", c.question);
        assert!(
            c.gold.iter().any(|g| has_phrase(text(c, g), answer)),
            "{}",
            c.id
        );
        for d in &c.documents {
            assert!(d.id.starts_with(prefix), "{}", d.id);
            let n = d.text.split_whitespace().count();
            assert!(range.contains(&n), "{}: {n} words", d.id);
            assert!(!d.text.contains(['{', '}']), "{}: {}", d.id, d.text);
            if !c.gold.contains(&d.id) {
                assert!(!has_phrase(&d.text, answer), "{answer} in {}", d.id);
            }
        }
        let ids: HashSet<&str> = c.documents.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids.len(), c.documents.len(), "unique ids");
        let names = named(&c.question);
        assert!(!names.is_empty(), "{}", c.question);
        for w in names {
            assert!(c.gold.iter().any(|g| has_phrase(text(c, g), w)), "{w}");
        }
    }

    #[test]
    fn profiles_are_seeded_and_sized() {
        let cases = profiles(12, 5, 7);
        assert_eq!(cases, profiles(12, 5, 7), "same seed, same cases");
        assert_ne!(cases, profiles(12, 5, 8));
        assert_eq!(cases.len(), 12);
        for documents in [2, 3, 4, 8] {
            for c in profiles(6, documents, 1) {
                assert_eq!(c.documents.len(), documents);
                check(&c, "prof", 200..=400);
            }
        }
    }

    #[test]
    fn profiles_need_both_hops() {
        for seed in [1, 2, 3] {
            let cases = profiles(200, 5, seed);
            let answers: HashSet<&String> = cases.iter().map(|c| &c.answers[0]).collect();
            assert_eq!(answers.len(), cases.len(), "answers are unique names");
            for (i, c) in cases.iter().enumerate() {
                check(c, &format!("prof{i}-"), 200..=400);
                assert_eq!(c.documents.len(), 5);
                assert_eq!(c.gold, [format!("prof{i}-a"), format!("prof{i}-b")]);
                let (a, b) = (text(c, &c.gold[0]), text(c, &c.gold[1]));
                let answer = &c.answers[0];
                assert!(has_phrase(b, answer) && !has_phrase(a, answer), "{}", c.id);
                // A's profile names B; B's profile does not name A.
                let b_name: Vec<&str> = b.split_whitespace().take(2).collect();
                assert!(has_phrase(a, &b_name.join(" ")), "{}", c.id);
                for w in named(&c.question) {
                    assert!(!has_phrase(b, w), "{w} in B's profile of {}", c.id);
                }
                // Paragraphs, not one block.
                assert!(a.split("\n\n").count() >= 3 && b.split("\n\n").count() >= 3);
            }
        }
    }

    #[test]
    fn a_distractor_names_the_same_role_in_an_alike_entity() {
        let skip = [
            "which",
            "town",
            "born",
            "university",
            "study",
            "retire",
            "ship",
            "band",
        ];
        for c in profiles(40, 5, 4) {
            let a = text(&c, &c.gold[0]);
            let d0 = text(&c, &(c.id.replace("profile-", "prof") + "-d0"));
            let role: Vec<&str> = named_not(&c.question, &skip);
            assert!(!role.is_empty(), "{}", c.question);
            for w in role {
                assert!(has_phrase(a, w) && has_phrase(d0, w), "{w} in {}", c.id);
            }
            // Its name shares A's first syllable.
            let first = |t: &str| {
                t.trim_start_matches("The ")
                    .chars()
                    .take(2)
                    .collect::<String>()
            };
            assert_eq!(first(a), first(d0), "{}", c.id);
        }
    }

    /// The lowercase words of a question longer than 3 letters, less `skip` and the closing
    /// instruction: for a profile question, the words of the role.
    fn named_not<'a>(q: &'a str, skip: &[&str]) -> Vec<&'a str> {
        q.trim_end_matches(" Answer with the name only.")
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| w.len() > 3 && w.starts_with(char::is_lowercase) && !skip.contains(w))
            .collect()
    }

    #[test]
    fn records_are_seeded_alike_and_answered_by_gold_only() {
        let cases = records(20, 5);
        assert_eq!(cases, records(20, 5), "same seed, same cases");
        assert_ne!(cases, records(20, 6));
        for seed in [1, 2, 3] {
            let cases = records(200, seed);
            assert_eq!(cases.len(), 200);
            let lookups = cases
                .iter()
                .filter(|c| c.question.starts_with("What"))
                .count();
            assert_eq!(lookups, 120, "60% lookups");
            for (i, c) in cases.iter().enumerate() {
                check(c, &format!("rec{i}-"), 40..=80);
                assert_eq!(c.documents.len(), 4);
                let want = if c.question.starts_with("What") { 1 } else { 2 };
                assert_eq!(c.gold.len(), want, "{}", c.question);
                assert!(has_phrase(text(c, &c.gold[0]), &c.answers[0]));
                // Alike: every record has the same field labels in the same order.
                let labels = |t: &str| -> Vec<String> {
                    t.split(". ")
                        .filter_map(|s| s.split_once(':').map(|(l, _)| l.to_string()))
                        .collect()
                };
                let first = labels(&c.documents[0].text);
                assert!(c.documents.iter().all(|d| labels(&d.text) == first));
                if want == 2 {
                    // The answer's record holds the larger value of the compared field.
                    let phrase = c
                        .question
                        .split("larger ")
                        .nth(1)
                        .and_then(|s| s.split(',').next());
                    let label = RECORDS
                        .iter()
                        .flat_map(|r| r.2.lines())
                        .find_map(|l| {
                            let mut it = l.trim().split(" | ");
                            let (label, asked) = (it.next()?, it.next()?);
                            (Some(asked) == phrase).then(|| format!("{label}: "))
                        })
                        .expect("the compared field");
                    let value = |id: &str| -> u32 {
                        text(c, id)
                            .split(". ")
                            .find_map(|s| {
                                s.strip_prefix(&label)?
                                    .split([' ', '.'])
                                    .next()?
                                    .parse()
                                    .ok()
                            })
                            .expect("a number")
                    };
                    assert!(value(&c.gold[0]) > value(&c.gold[1]), "{}", c.question);
                }
            }
        }
    }
}
