/**
 * The part of JupyterLab's TranslationBundle the views use, and a stand-in
 * that behaves like `nullTranslator.load(…)`: the pure modules take one as
 * their last argument, so `npm test` runs them under Node without JupyterLab.
 */

/** `translator.load('jupyter_gpufrac')` satisfies this. */
export interface ITrans {
  __(msgid: string, ...args: Array<string | number>): string;
  _n(
    msgid: string,
    msgidPlural: string,
    n: number,
    ...args: Array<string | number>
  ): string;
}

/** The translation domain, as the Python language packs name it. */
export const TRANSLATION_DOMAIN = 'jupyter_gpufrac';

// Gettext.strfmt's rules: %1, %2… are the arguments; an argument's own text
// is never read for placeholders.
function strfmt(text: string, args: Array<string | number>): string {
  return text.replace(/%(\d+)/g, (match, i: string) => {
    const arg = args[Number(i) - 1];
    return arg === undefined ? match : String(arg);
  });
}

/** English as written; `_n`'s count is %1, as in JupyterLab's bundles. */
export const defaultTrans: ITrans = {
  __: (msgid, ...args) => strfmt(msgid, args),
  _n: (msgid, msgidPlural, n, ...args) =>
    strfmt(n === 1 ? msgid : msgidPlural, [n, ...args])
};
