//! `sqlx::migrate!` embeds `../migrations` at compile time; without this a
//! changed or added migration would not rebuild the crate.

fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
