//! Enums with a text of their own (on the wire, in files, on the command line): one macro writes
//! the text, its parse and `Display`, so that a variant cannot be spelled one way out and
//! another way in.

/// `names! { /// doc  #[derive(..)] pub enum Ty { /// doc  Variant => "text", … } }` declares
/// the enum (unit variants, each with its text beside it) and gives `Ty::ALL` (every variant, in
/// the order declared), `Ty::as_str`, `Ty::parse` (the inverse of `as_str`) and `Display` (the
/// text).
#[macro_export]
macro_rules! names {
    (
        $(#[$meta:meta])*
        $vis:vis enum $ty:ident {
            $($(#[$vmeta:meta])* $variant:ident => $name:literal),* $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $ty {
            $($(#[$vmeta])* $variant),*
        }
        impl $ty {
            pub const ALL: [$ty; [$($name),*].len()] = [$($ty::$variant),*];
            pub fn as_str(self) -> &'static str {
                match self { $($ty::$variant => $name),* }
            }
            pub fn parse(s: &str) -> Option<$ty> {
                match s { $($name => Some($ty::$variant),)* _ => None }
            }
        }
        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
